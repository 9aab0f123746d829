"""Environment faults are survived and counted; slow environments do not stall the engine.

A raising factory/reset/step, a malformed result, a step timeout (plain and async), an episode timeout: each ends
only its own episode, with its reason and `failure_reward`; the other episodes of the group finish normally, and
the `env/...` metrics count what happened.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from actors.environments.episodes import EpisodeDriver, EpisodeLimits
from actors.environments.runner import EnvRunner
from actors.environments.trajectory import build_episode_group
from common.types import PromptItem
from launch.testing import drive_until_done
from tests.actors.env_fakes import AsyncScriptedEnv, ScriptedEngine, ScriptedEnv, ScriptedFactory, Turn

TASK = PromptItem(prompt_id=1, epoch=0, messages=[{"role": "user", "content": "Play."}], metadata={})
FAILURE = -0.5


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def runner():
    runner = EnvRunner(workers=8)
    yield runner
    runner.close()


def limits(**overrides) -> EpisodeLimits:
    values = {
        "max_turns": 6,
        "max_total_tokens": 2048,
        "turn_max_tokens": 6,
        "max_model_len": 8192,
        "step_timeout_s": 2.0,
        "episode_timeout_s": 20.0,
        "failure_reward": FAILURE,
    }
    values.update(overrides)
    return EpisodeLimits(**values)


def two_turns(**last) -> list[Turn]:
    return [Turn(obs="again", reward=0.5), Turn(done=True, reward=1.0, **last)]


class Boom:
    def __call__(self):
        raise ValueError("cannot build the environment")


def test_each_fault_ends_only_its_episode_and_is_counted(tokenizer, runner) -> None:
    engine = ScriptedEngine(tokenizer, seed=0)
    envs = [
        ScriptedEnv(two_turns()),  # 0: fine
        ScriptedEnv(two_turns(raises=True)),  # 1: step raises on turn 2
        ScriptedEnv(two_turns(), reset_raises=True),  # 2: reset raises
        ScriptedEnv(two_turns(garbage=True)),  # 3: step returns a dict
        ScriptedEnv(two_turns(sleep_s=10.0)),  # 4: plain step overruns the timeout
        AsyncScriptedEnv(two_turns(sleep_s=30.0)),  # 5: async step overruns (cancelled)
        AsyncScriptedEnv(two_turns()),  # 6: fine, async
    ]
    factories = iter([*(lambda env=env: env for env in envs), Boom()])  # 7: the factory raises
    # step_timeout_s: 1 s, long enough that a fine environment's instant step never times out on a loaded machine,
    # well under the 10 s that environment 4's step sleeps
    driver = EpisodeDriver(engine, lambda: next(factories)(), limits(step_timeout_s=1.0), runner, group_size=8)
    started = time.monotonic()
    driver.start_group(2, TASK)
    (done,) = drive_until_done(driver, timeout_s=20)
    # waiting for environment 4's step would take >= 10 s; the group itself needs ~1 s (two turns, a 1 s timeout),
    # so 10 s tells the two apart with a margin for a loaded machine (stuck_calls below says the same from state)
    assert time.monotonic() - started < 10, "a timed-out call must not be waited for"
    group = build_episode_group(2, TASK, done.results, 0, 0.0)
    group.validate()
    reasons = group.finish_reasons
    # each fine episode ends "done", or "length" when its last turn hit max_tokens: the scripted engine's turn
    # lengths follow the order requests arrive in, which the plain and the async environment's timing decides
    assert reasons[0] in ("done", "length") and reasons[6] in ("done", "length")
    assert reasons[1] == "env_error: step: RuntimeError: step exploded"
    assert reasons[2] == "env_error: reset: RuntimeError: reset exploded"
    assert reasons[3].startswith("env_error: step: step() must return common.envs.StepResult, got dict")
    assert reasons[4] == reasons[5] == "env_timeout"
    assert reasons[7] == "env_error: factory: ValueError: cannot build the environment"
    np.testing.assert_allclose(group.rewards, [1.5, FAILURE, FAILURE, FAILURE, FAILURE, FAILURE, 1.5, FAILURE])
    np.testing.assert_allclose(group.reward_components["failure"], [0, *[FAILURE] * 5, 0, FAILURE])
    for i in (2, 7):  # ended before any turn: the task's own chat is the prompt, nothing to train on
        assert group.offsets[i + 1] - group.offsets[i] == 0
    metrics = driver.metrics()
    assert metrics["env/episodes"] == 8
    assert metrics["env/failures"] == 4 and metrics["env/timeouts"] == 2
    assert metrics["env/failure_rate"] == pytest.approx(6 / 8)
    assert metrics["env/step_s_mean"] > 0
    assert metrics["env/stuck_calls"] == 1  # the plain step still sleeps in its thread...
    deadline = time.monotonic() + 20  # environment 4's step returns 10 s after it started
    while runner.stuck_calls and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runner.stuck_calls == 0  # ... until it returns


def test_episode_timeout_aborts_a_long_episode(tokenizer, runner) -> None:
    engine = ScriptedEngine(tokenizer, seed=1, step_s=0.01)
    endless = [Turn(obs="go on", reward=0.1, sleep_s=0.05)]  # never done
    driver = EpisodeDriver(
        engine,
        ScriptedFactory([ScriptedEnv(endless), ScriptedEnv([Turn(done=True)])]),
        limits(max_turns=1000, episode_timeout_s=0.6),
        runner,
        group_size=2,
    )
    driver.start_group(2, TASK)
    (done,) = drive_until_done(driver, timeout_s=10)
    group = build_episode_group(2, TASK, done.results, 0, 0.0)
    assert group.finish_reasons[0] == "episode_timeout" and group.rewards[0] == pytest.approx(FAILURE)
    assert group.finish_reasons[1] in ("done", "length")
    assert engine.num_unfinished() == 0


def test_slow_environments_do_not_stall_the_engine(tokenizer) -> None:
    """16 episodes x 3 steps of 0.3 s each: run one after the other they take 14 s; concurrently ~1 s. While one
    slow environment (3 s) computes, the engine keeps sampling the others' turns and they all finish first."""
    engine = ScriptedEngine(tokenizer, seed=2, max_tokens=4, step_s=0.002)
    slow = ScriptedEnv([Turn(obs="x", sleep_s=3.0), Turn(done=True)])
    envs = [slow] + [ScriptedEnv([Turn(obs="x", sleep_s=0.3)] * 2 + [Turn(done=True, sleep_s=0.3)]) for _ in range(15)]
    finished_at: dict[int, float] = {}
    runner = EnvRunner(workers=16)  # one thread per episode: plain steps run side by side
    try:
        driver = EpisodeDriver(engine, ScriptedFactory(envs), limits(step_timeout_s=5.0), runner, group_size=16)
        started = time.monotonic()
        driver.start_group(2, TASK)
        pending = driver.groups[(2, 1)]
        while driver.active():
            driver.advance()
            for i, result in enumerate(pending.results):
                if result is not None:
                    finished_at.setdefault(i, time.monotonic() - started)
            if engine.num_unfinished():
                for sample in engine.step():
                    driver.on_turn(sample)
            else:
                driver.wait(0.005)
    finally:
        runner.close()
    elapsed = time.monotonic() - started
    assert elapsed < 6.0, f"{elapsed:.1f}s: environment steps ran one after the other"
    assert max(finished_at[i] for i in range(1, 16)) < finished_at[0] - 1.0
    assert engine.steps > 20
    assert all(r.finish_reason in ("done", "length") for r in pending.results)
