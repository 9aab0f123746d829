"""`tandem generator` with a multi-turn environment (SIMULATION engine) against a fake buffer over loopback.

The production path end to end: leases -> episodes (env.environment = tests.actors.env_fakes:TwoTurnEnv) ->
groups with environment tokens pushed to the buffer. Prompts marked `explode` raise in the environment and `slow`
ones overrun env.step_timeout_s (stuck for minutes): those episodes end with failure_reward, the generator stays
up, serves every prompt, counts the faults in its `env/...` metrics, and exits when the prompts are exhausted
without waiting for the stuck environment threads.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from actors.engine.simulated import SIM_END_OF_TURN
from common.metrics import read_metrics
from common.types import PromptItem
from launch.testing import FakeBuffer, FakePublisher, RoleUnderTest, run_config

pytestmark = pytest.mark.integration  # starts role processes

GROUP_SIZE = 3
SIM_TOKENS = 5
FAILURE = -1.0


def items() -> list[PromptItem]:
    prompts = []
    for i in range(8):
        metadata = {"answer": i, "explode": i == 2, "slow": i == 5}
        prompts.append(
            PromptItem(prompt_id=i, epoch=0, messages=[{"role": "user", "content": f"Task {i}"}], metadata=metadata)
        )
    return prompts


def test_multi_turn_groups_faults_survived_and_counted(tmp_path) -> None:
    config = run_config(
        tmp_path / "runs",
        "gen",
        run={"simulate": True},
        algo={"group_size": GROUP_SIZE},
        env={
            "environment": "tests.actors.env_fakes:TwoTurnEnv",
            "step_timeout_s": 2.0,  # an instant step never overruns it on a loaded machine; prompt 5's sleeps 120 s
            "failure_reward": FAILURE,
            "max_turns": 4,
        },
        generator={"sim_tokens": SIM_TOKENS, "sim_token_s": 0.002, "prompts_in_flight": 4, "reconnect_max_s": 0.5},
    )
    with (
        FakeBuffer(config, items(), lease_size=2) as buffer,
        FakePublisher(config.learner.weights_port),
        RoleUnderTest(config, "generator") as generator,
    ):
        started = time.monotonic()
        code, err = generator.wait(90), generator.output()
    assert code == 0, err[-3000:]
    assert time.monotonic() - started < 45, "a stuck environment thread must not keep the generator alive"
    groups = {g.prompt_id: g for g in buffer.wait_for_groups(8, timeout_s=1)}
    assert sorted(groups) == list(range(8))
    for prompt_id, group in groups.items():
        group.validate()
        if prompt_id in (2, 5):
            reason = (
                "env_timeout" if prompt_id == 5 else "env_error: step: RuntimeError: environment exploded on prompt 2"
            )
            assert group.finish_reasons == [reason] * GROUP_SIZE
            np.testing.assert_array_equal(group.rewards, FAILURE)
            assert np.all(group.loss_mask == 1) and np.all(np.diff(group.offsets) == SIM_TOKENS)  # one turn
            continue
        assert all(r in ("done", "length") for r in group.finish_reasons)  # sim turns always end by length
        np.testing.assert_allclose(group.rewards, 1.25)
        np.testing.assert_allclose(group.reward_components["turn_reward_sum"], 0.25)
        np.testing.assert_allclose(group.reward_components["terminal"], 1.0)
        for i in range(GROUP_SIZE):
            span = slice(int(group.offsets[i]), int(group.offsets[i + 1]))
            mask, tokens = group.loss_mask[span], group.completion_tokens[span]
            # model turn, environment tokens (end-of-turn + the rendered observation), model turn
            assert mask[:SIM_TOKENS].all() and mask[-SIM_TOKENS:].all() and not mask[SIM_TOKENS:-SIM_TOKENS].any()
            env_tokens = tokens[SIM_TOKENS:-SIM_TOKENS]
            assert env_tokens[0] == SIM_END_OF_TURN
            assert bytes(env_tokens[1:].tolist()).decode() == "\nuser: Are you sure? Check again.\nassistant: "
            assert np.all(group.token_versions[span][mask == 0] == -1)
    records = read_metrics(tmp_path / "runs" / "gen" / "generator-0.jsonl")
    last = records[-1]
    assert last["env/episodes"] == 8 * GROUP_SIZE
    assert last["env/failures"] == GROUP_SIZE and last["env/timeouts"] == GROUP_SIZE
    assert last["env/failure_rate"] == pytest.approx(2 / 8)
    assert any(r.get("env/turns_mean", 0) > 1 for r in records)
    assert "ended env_timeout" in err and "environment exploded" in err
