"""No plug-in freezes its host (issue 37): an environment or reward function that raises any BaseException, or
blocks inside async code, ends only its own episode; the runner's event loop and the generator go on.

Before: a SystemExit or KeyboardInterrupt in an async environment left the runner's event loop (every later
episode hung: 0 groups for the rest of the run), a GeneratorExit or custom BaseException reached the generator's
loop through the call's future, and a time.sleep in `async def step` held every other episode as long as it slept.
"""

from __future__ import annotations

import logging
import time

import pytest

from actors.environments.episodes import EpisodeDriver, EpisodeLimits
from actors.environments.runner import EnvRunner
from actors.environments.trajectory import build_episode_group
from actors.rewards.functions import RewardScorer
from common.config import EnvConfig
from common.types import PromptItem
from launch.testing import drive_until_done
from tests.actors.env_fakes import AsyncScriptedEnv, BadPluginEnv, ScriptedEngine, ScriptedEnv, Turn

TASK = PromptItem(prompt_id=1, epoch=0, messages=[{"role": "user", "content": "Play."}], metadata={})
FAILURE = -0.5


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def limits(step_timeout_s: float) -> EpisodeLimits:
    return EpisodeLimits(6, 2048, 6, 8192, step_timeout_s, 30.0, FAILURE)


class ExitingPlainEnv(ScriptedEnv):
    def step(self, model_turn_text: str):
        raise SystemExit(5)


def run_group(tokenizer, runner: EnvRunner, envs: list, step_timeout_s: float = 5.0, seed: int = 0):
    engine = ScriptedEngine(tokenizer, seed=seed, max_tokens=4)
    factories = iter(envs)
    driver = EpisodeDriver(engine, lambda: next(factories), limits(step_timeout_s), runner, group_size=len(envs))
    driver.start_group(2, TASK)
    (done,) = drive_until_done(driver, timeout_s=30)
    group = build_episode_group(2, TASK, done.results, 0, 0.0)
    group.validate()
    return group, driver.metrics()


def test_every_base_exception_ends_its_own_episode_and_the_loop_serves_on(tokenizer) -> None:
    runner = EnvRunner(workers=4)
    try:
        hows = ["exit", "interrupt", "generator_exit", "custom", "in_task"]
        envs = [BadPluginEnv(how) for how in hows] + [ExitingPlainEnv([Turn()]), AsyncScriptedEnv([Turn(done=True)])]
        group, metrics = run_group(tokenizer, runner, envs)
        reasons = list(group.finish_reasons)
        assert reasons[:6] == [
            "env_error: step: SystemExit: 3",
            "env_error: step: KeyboardInterrupt: interrupted",
            "env_error: step: GeneratorExit: closed",
            "env_error: step: CustomBaseError: custom",
            "env_error: step: SystemExit: 4",  # raised in a task the environment started
            "env_error: step: SystemExit: 5",  # a plain step, in a worker thread
        ]
        assert reasons[6] in ("done", "length") and metrics["env/failures"] == 6
        # the same runner (its loop) still serves a whole group afterwards
        again, _ = run_group(tokenizer, runner, [AsyncScriptedEnv([Turn(obs="x"), Turn(done=True)]) for _ in range(3)])
        assert all(reason in ("done", "length") for reason in again.finish_reasons)
        assert runner.loop_escapes == 0
    finally:
        runner.close()


def test_a_blocking_async_step_times_out_alone_and_is_reported_by_name(tokenizer, caplog) -> None:
    """One episode's `async def step` sleeps 3 s with time.sleep (holding the shared loop); the step timeout is
    1 s. It ends env_timeout at about its deadline (the watchdog, not the held loop, times it out), the other
    episodes' deadlines move by the time the loop was held, so they finish `done`, and the block is logged with
    the environment's name and the line it blocked at."""
    runner = EnvRunner(workers=4, block_warn_s=0.3)
    caplog.set_level(logging.WARNING, logger="tandem.actors.env_runner")
    try:
        fine = [AsyncScriptedEnv([Turn(obs="x", sleep_s=0.05)] * 3 + [Turn(done=True)]) for _ in range(5)]
        started = time.monotonic()
        group, metrics = run_group(tokenizer, runner, [BadPluginEnv("block", block_s=3.0), *fine], step_timeout_s=1.0)
        elapsed = time.monotonic() - started
    finally:
        runner.close()
    reasons = list(group.finish_reasons)
    assert reasons[0] == "env_timeout"
    assert all(reason in ("done", "length") for reason in reasons[1:]), reasons
    assert metrics["env/loop_blocks"] == 1 and metrics["env/loop_blocked_s"] >= 2.9
    assert metrics["env/timeouts"] == 1
    assert elapsed < 15
    text = caplog.text
    assert "tests.actors.env_fakes.BadPluginEnv.step has held the environments' event loop" in text
    assert "env_fakes.py" in text and "in misbehave" in text  # where it blocks


def exiting_reward(completion: str, metadata: dict) -> float:
    if "exit" in metadata:
        raise SystemExit(metadata["exit"])
    if "interrupt" in metadata:
        raise KeyboardInterrupt("reward interrupted")
    return 1.0


def test_a_reward_function_raising_system_exit_gets_the_failure_reward() -> None:
    scorer = RewardScorer(EnvConfig(reward_fn=f"{__name__}:exiting_reward", failure_reward=FAILURE))
    failed = scorer.score("text", {"exit": 2})
    assert failed.reward == FAILURE and failed.error == "SystemExit: 2"
    interrupted = scorer.score("text", {"interrupt": True})
    assert interrupted.reward == FAILURE and interrupted.error == "KeyboardInterrupt: reward interrupted"
    assert scorer.score("text", {}).reward == 1.0 and scorer.errors == 2


@pytest.mark.integration
def test_the_generator_delivers_every_group_past_exiting_and_blocking_environments(tmp_path) -> None:
    """`tandem generator` (SIMULATION engine) with an async environment: prompt 2's step raises SystemExit, prompt
    3's KeyboardInterrupt, prompt 5's blocks its event loop for 4 s. Every group arrives; only those end failed."""
    from launch.testing import FakeBuffer, FakePublisher, RoleUnderTest, run_config

    faults = {2: {"plugin_fault": "exit"}, 3: {"plugin_fault": "interrupt"}, 5: {"plugin_fault": "block", "block_s": 4}}
    prompts = [
        PromptItem(i, 0, [{"role": "user", "content": f"Task {i}"}], {"answer": i, **faults.get(i, {})})
        for i in range(8)
    ]
    config = run_config(
        tmp_path / "runs",
        "gen",
        run={"simulate": True},
        algo={"group_size": 2},
        env={"environment": "tests.actors.env_fakes:AsyncTwoTurnEnv", "step_timeout_s": 1.5, "failure_reward": -1.0},
        generator={"sim_tokens": 5, "sim_token_s": 0.002, "prompts_in_flight": 4, "reconnect_max_s": 0.5},
    )
    with (
        FakeBuffer(config, prompts, lease_size=2) as buffer,
        FakePublisher(config.learner.weights_port),
        RoleUnderTest(config, "generator") as generator,
    ):
        code, err = generator.wait(90), generator.output()
    assert code == 0, err[-3000:]
    groups = {g.prompt_id: g for g in buffer.wait_for_groups(8, timeout_s=1)}
    assert sorted(groups) == list(range(8))
    assert list(groups[2].finish_reasons) == ["env_error: step: SystemExit: 3"] * 2
    assert list(groups[3].finish_reasons) == ["env_error: step: KeyboardInterrupt: interrupted"] * 2
    assert "env_timeout" in groups[5].finish_reasons
    for prompt_id in (0, 1, 4, 6, 7):
        assert all(r in ("done", "length") for r in groups[prompt_id].finish_reasons), groups[prompt_id]
    assert "AsyncTwoTurnEnv.step has held the environments' event loop" in err
