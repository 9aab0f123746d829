"""The environment contract (common/envs.py) and its `[env]` keys: resolving, checking results, the reward adapter."""

from __future__ import annotations

from typing import ClassVar

import pytest

from common.config import ConfigError, load_config
from common.envs import (
    RewardFnEnvironment,
    StepResult,
    check_first_observation,
    check_step_result,
    environment_factory,
    resolve_environment,
)
from common.types import PromptItem

TASK = PromptItem(
    prompt_id=0, epoch=0, messages=[{"role": "user", "content": "What is 2 + 2?"}], metadata={"answer": 4}
)


class Echo:
    def __init__(self, suffix: str = "!") -> None:
        self.suffix = suffix

    def reset(self, task):
        return task.messages

    def step(self, text):
        return StepResult([{"role": "user", "content": text + self.suffix}])


class Prepared(Echo):
    """An environment with a start-up check: refuses suffix "bad", records what it was prepared with."""

    prepared: ClassVar[list[dict]] = []

    @classmethod
    def prepare(cls, **arguments: str) -> None:
        if arguments.get("suffix") == "bad":
            raise ValueError("env.environment_args.suffix: 'bad' is refused")
        cls.prepared.append(arguments)


NOT_AN_ENV = 3


class NoStep:
    def reset(self, task):
        return task.messages


def test_reward_function_is_a_one_step_environment() -> None:
    env = environment_factory(load_config(None).env)()  # default: common.tasks:arithmetic_reward
    assert isinstance(env, RewardFnEnvironment)
    assert env.reset(TASK) == TASK.messages
    result = env.step("It is 4.\n#### 4")
    assert result.done and result.observation == [] and result.reward == pytest.approx(1.1)
    assert result.info["components"] == {"correct": 1.0, "format": pytest.approx(0.1)}


def test_environment_factory_passes_the_configured_arguments() -> None:
    config = load_config(
        None, {"env.environment": "tests.common.test_envs:Echo", "env.environment_args": {"suffix": "?"}}
    )
    env = environment_factory(config.env)()
    assert type(env).__name__ == "Echo" and env.suffix == "?"  # (this file is imported twice: by name and path)


class Counted(Echo):
    """An environment whose class reports process-wide counts (common.envs: process_metrics)."""

    @classmethod
    def process_metrics(cls) -> dict[str, float]:
        return {"env/counted": 7.0}


def test_environment_factory_carries_the_classes_process_metrics() -> None:
    counted = load_config(None, {"env.environment": "tests.common.test_envs:Counted"}).env
    assert environment_factory(counted).process_metrics() == {"env/counted": 7.0}
    plain = load_config(None, {"env.environment": "tests.common.test_envs:Echo"}).env
    assert environment_factory(plain).process_metrics is None


def test_environment_prepare_runs_once_at_start_up_with_the_arguments() -> None:
    env = load_config(
        None, {"env.environment": "tests.common.test_envs:Prepared", "env.environment_args": {"suffix": "?"}}
    ).env
    factory = environment_factory(env)
    prepared = resolve_environment(env.environment).prepared  # (the class as the factory imported it)
    assert prepared == [{"suffix": "?"}]
    factory(), factory()
    assert prepared == [{"suffix": "?"}]  # once at start-up, not once per episode
    with pytest.raises(ValueError, match="'bad' is refused"):
        environment_factory(env.model_copy(update={"environment_args": {"suffix": "bad"}}))


@pytest.mark.parametrize(
    "spec, error, message",
    [
        ("tests.common.no_such_module:Echo", ImportError, "cannot import"),
        ("tests.common.test_envs:Missing", AttributeError, "no attribute 'Missing'"),
        ("tests.common.test_envs:NOT_AN_ENV", TypeError, "not a class or factory"),
        ("tests.common.test_envs:NoStep", TypeError, "needs reset"),
    ],
)
def test_a_misnamed_environment_fails_with_what_to_change(spec: str, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        resolve_environment(spec)


def test_config_rejects_a_malformed_environment_spec() -> None:
    with pytest.raises(ConfigError, match="env.environment"):
        load_config(None, {"env.environment": "no colon here"})
    with pytest.raises(ConfigError, match="env.max_turns"):
        load_config(None, {"env.max_turns": 0})


@pytest.mark.parametrize(
    "value, message",
    [
        ({"observation": []}, "must return common.envs.StepResult"),
        (StepResult([{"role": "user"}]), r"observation\[0\] must be a dict"),
        (StepResult("text"), "must be a list of chat messages"),
        (StepResult([], reward=float("nan"), done=True), "finite"),
        (StepResult([], reward="1", done=True), "finite"),
        (StepResult([], done=False), "no observation and done=False"),
    ],
)
def test_malformed_step_results_say_what_is_wrong(value, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        check_step_result(value)


def test_checked_results_and_observations() -> None:
    result = check_step_result(StepResult([{"role": "tool", "content": "42", "extra": "dropped"}], reward=1))
    assert result.observation == [{"role": "tool", "content": "42"}] and result.reward == 1.0
    with pytest.raises(ValueError, match="non-empty"):
        check_first_observation([])
