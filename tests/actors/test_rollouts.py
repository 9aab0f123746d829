"""The generator's one rollout seam (actors/rollouts.py): single-turn and multi-turn driven by the same calls, one
rule for a failing reward or environment. The SIMULATION engine, no sockets; the whole generator over both kinds
runs in test_generator_sim.py and test_env_generator_sim.py."""

from __future__ import annotations

import time

import pytest

from actors.engine.simulated import SimEngine
from actors.rollouts import EpisodeRollouts, Rollouts, SingleTurnRollouts, rollouts_maker
from common.config import EnvConfig
from common.types import RolloutGroup
from launch.testing import arithmetic_items, run_config

FAILURE = -0.75  # env.failure_reward: exactly representable in float32, so the group's rewards hold it exactly
GROUP = 2


def _drive(rollouts: Rollouts, engine: SimEngine, prompts: int, timeout_s: float = 60.0) -> list[RolloutGroup]:
    """The generator's phases 6-7 (actors/generator.py) until every started prompt came back as a group."""
    for prompt in arithmetic_items(prompts, explode_every=2):  # prompts 0, 2, ... make the reward or env raise
        assert rollouts.start(lease_id=1, prompt=prompt)
    groups: list[RolloutGroup] = []
    deadline = time.monotonic() + timeout_s
    while rollouts.active():
        assert time.monotonic() < deadline, "rollouts did not finish"
        rollouts.advance(submit=True)
        if engine.num_unfinished():
            for sample in engine.step():
                rollouts.on_sample(sample)
        elif rollouts.background():
            rollouts.wait(0.01)
        groups.extend(rollouts.finished(time.monotonic()))
    return sorted(groups, key=lambda g: g.prompt_id)


def _rollouts(tmp_path, env: dict) -> tuple[Rollouts, SimEngine]:
    config = run_config(
        tmp_path / "runs",
        "rollouts",
        run={"simulate": True},
        algo={"group_size": GROUP},
        env={"failure_reward": FAILURE, "stop_failure_share": 1.0, **env},  # the guard: test_failure_guard.py
        generator={"sim_tokens": 4},
    )
    engine = SimEngine(4, 0.0, max_num_seqs=16, seed=0)
    return rollouts_maker(config, generator_id=3)(engine), engine


@pytest.mark.parametrize(
    ("env", "kind", "failed_reason"),
    [
        ({"reward_fn": "tests.actors.reward_fns:explode_or_length"}, SingleTurnRollouts, "env_error: reward: "),
        ({"environment": "tests.actors.env_fakes:TwoTurnEnv"}, EpisodeRollouts, "env_error: step: "),
    ],
    ids=["single-turn", "multi-turn"],
)
def test_both_kinds_run_through_one_seam_with_one_failure_rule(tmp_path, env, kind, failed_reason):
    rollouts, engine = _rollouts(tmp_path, env)
    assert isinstance(rollouts, kind)
    groups = _drive(rollouts, engine, prompts=4)
    assert [g.prompt_id for g in groups] == [0, 1, 2, 3] and {g.generator_id for g in groups} == {3}
    for group in groups:
        group.validate()
        exploded = group.prompt_id % 2 == 0
        assert all(r.startswith(failed_reason) for r in group.finish_reasons) == exploded, group.finish_reasons
        if exploded:  # the sample keeps its tokens and gets env.failure_reward, whichever kind failed
            assert group.rewards.tolist() == [FAILURE] * GROUP
            assert len(group.completion_tokens) > 0
        else:
            assert all(r > 0 for r in group.rewards)
    assert rollouts.request_ids() == [] and not rollouts.active()
    rollouts.close()


def test_a_prompt_too_long_for_the_model_is_given_up_and_counted(tmp_path):
    rollouts, engine = _rollouts(tmp_path, {"reward_fn": "tests.actors.reward_fns:explode_or_length"})
    rollouts.max_model_len = 3  # every rendered arithmetic prompt is longer
    assert not rollouts.start(lease_id=1, prompt=arithmetic_items(1)[0])
    assert engine.num_unfinished() == 0 and not rollouts.active()
    assert rollouts.metrics()["actor/prompts_too_long"] == 1


def test_fallback_reward_is_the_old_name_of_failure_reward():
    assert EnvConfig(fallback_reward=-1.0).failure_reward == -1.0
    assert EnvConfig(fallback_reward=-1.0, failure_reward=-1.0).failure_reward == -1.0
    with pytest.raises(ValueError, match="keep failure_reward only"):
        EnvConfig(fallback_reward=-1.0, failure_reward=0.5)
