"""The environment interface of multi-turn (agentic) RL, and the adapter that makes every reward function one.

A user's environment is a few lines; `reset` and `step` may be plain functions or `async def`:

    class Countdown:
        def reset(self, task):                      # task: a leased PromptItem (.messages, .metadata)
            self.left = int(task.metadata["turns"])
            return task.messages                    # the first observation: the chat the model answers first
        async def step(self, text):                 # the text of the model's turn
            self.left -= 1
            done = self.left == 0
            return StepResult([{"role": "user", "content": "Go on."}], reward=float(done), done=done)

    # config:  [env] environment = "my_pkg.envs:Countdown"   environment_args = {...}

Contract between an environment and the generator's episode driver (`actors.environments.episodes`):
  * One instance per episode: the factory `env.environment` names is called with `env.environment_args` as keyword
    arguments (keep it cheap: it runs on the generator's loop; slow set-up belongs in `reset`), then `reset(task)`
    once, then `step(text)` once per model turn until a step says `done` or a limit ends the episode, then
    `close()` if the object has one.
  * Optional start-up check: a factory with a `prepare(**environment_args)` method (a classmethod, say) has it
    called once when the generator starts, with the same arguments; it may check them and set up what every
    episode shares (a server, a cache), and raising there stops the generator with its reason.
  * `reset` returns the first observation: a non-empty chat (`[{"role": ..., "content": ...}]`), usually
    `task.messages`. The group's `n` episodes may open with different observations.
  * Optional tools: an environment (class or instance) with a non-empty `tools` attribute, an OpenAI-format list
    `[{"type": "function", "function": {"name", "description", "parameters": <JSON schema object>}}]` read after
    `reset`, has it checked (`common.tool_calls.check_tools`; a bad list is an `env_error`) and the Hermes tools
    block added to the first observation's system message (`common.tool_calls.with_tools`, or a new first system
    message). The model then calls tools as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in its turn;
    `step` parses them (`parse_tool_calls`), runs them (`Toolbox`) and answers with `tool` messages (`tool_message`).
    Example: examples/envs/tool_calculator.py.
  * Optional turn counts: an environment with `on_model_turn(prompt_tokens, completion_tokens, finish_reason)` has
    it called after each model turn, before that turn's `step`, on the generator's loop (keep it cheap: a plain
    `def` that stores the numbers): prompt_tokens is the whole context the model was given for the turn,
    completion_tokens the tokens it sampled, finish_reason the engine's "stop" or "length". Raising there ends the
    episode as `env_error: on_model_turn: ...`. The OpenAI endpoint reports its usage from it.
  * Optional process metrics: an environment class with a `process_metrics()` classmethod (counts of what its
    process-wide parts did, e.g. the OpenAI endpoint's refused requests) has them added to the generator's metrics
    at every report (`env/...` keys; a raising one is logged and skipped).
  * `step` gets the model's turn decoded from the tokens it sampled (special tokens skipped; a turn cut by
    `generator.max_tokens` is passed as it is) and returns a `StepResult`: the NEW messages that follow the model's
    turn (usually one `user` or `tool` message; ignored when `done`), this turn's reward, and whether the episode is
    over. The episode's reward is the sum of its step rewards.
  * Calls run off the engine loop (async ones on one event loop, plain ones in `env.env_workers` threads), each
    bounded by `env.step_timeout_s` and the episode by `env.episode_timeout_s`. An `async` method must not block
    (it would stall every other async environment): write blocking code as a plain `def`.
  * Failure modes: a call that raises, returns a malformed result or overruns its timeout ends the episode with
    the finish reason `env_error: <Type>: <message>` or `env_timeout` and the reward `env.failure_reward`; the
    generator stays up and counts it. A plain function that overruns keeps its worker thread until it returns.

Importing this module is cheap (no torch, no tokenizer); it is part of the shared contract (`common/`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.config import EnvConfig
from common.plugins import resolve_callable

VERIFIERS_PREFIX = "verifiers:"  # env.environment = "verifiers:<taskset id or module>" (docs/environments.md)
VERIFIERS_LOADER = "actors.environments.verifiers_env:verifiers_factory"

Message = dict[str, str]  # {"role": "user" | "assistant" | "tool" | "system", "content": str} (+ tool fields)
TOOL_FIELDS = ("tool_call_id", "name")  # kept on a message when strings: chat templates may render them


class Task(Protocol):
    """What `reset` receives: a leased prompt (`common.types.PromptItem`) or anything with the same fields."""

    @property
    def messages(self) -> list[Message]: ...

    @property
    def metadata(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class StepResult:
    """What `Environment.step` returns.

    observation: the messages that follow the model's turn, in order (rendered with the chat template after it);
                 may be empty only when `done` (the observation of a final step is not rendered).
    reward:      this turn's reward (finite); the episode's reward is the sum over its steps.
    done:        the episode is over (the finish reason becomes `done`).
    info:        free-form diagnostics, but for one key the driver reads: `info["components"]`, named parts of
                 the reward of the step that says done (a rubric's, say; finite numbers): they reach the buffer as
                 reward components, and what they leave of `reward` stays in `terminal` (actors.environments.episodes).
    """

    observation: list[Message]
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    """One episode's environment (the contract is in the module docstring). Methods may be `async def`."""

    def reset(self, task: Task) -> list[Message] | Awaitable[list[Message]]: ...

    def step(self, model_turn_text: str) -> StepResult | Awaitable[StepResult]: ...


EnvironmentFactory = Callable[[], Environment]


def check_messages(value: Any, what: str) -> list[Message]:
    """`value` as a chat (role, content and the TOOL_FIELDS a message has), or TypeError naming `what` and the
    first bad message."""
    if not isinstance(value, list):
        raise TypeError(f"{what} must be a list of chat messages, got {type(value).__name__}")
    for i, message in enumerate(value):
        if (
            not isinstance(message, Mapping)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise TypeError(f"{what}[{i}] must be a dict with string 'role' and 'content', got {message!r:.200}")
    return [
        {"role": m["role"], "content": m["content"], **{k: m[k] for k in TOOL_FIELDS if isinstance(m.get(k), str)}}
        for m in value
    ]


def check_first_observation(value: Any) -> list[Message]:
    """What `reset` returned, as a non-empty chat; TypeError/ValueError saying what is wrong."""
    messages = check_messages(value, "reset() observation")
    if not messages:
        raise ValueError("reset() must return a non-empty chat: the model needs something to answer")
    return messages


def check_step_result(value: Any) -> StepResult:
    """What `step` returned, checked: a `StepResult` with a valid observation and a finite reward.

    Raises TypeError/ValueError with what to change (the driver turns it into an `env_error` finish reason).
    """
    if not isinstance(value, StepResult):
        raise TypeError(f"step() must return common.envs.StepResult, got {type(value).__name__}")
    observation = check_messages(value.observation, "step() observation")
    if not isinstance(value.reward, numbers.Real) or not math.isfinite(float(value.reward)):
        raise ValueError(f"step() reward must be a finite number, got {value.reward!r}")
    if not value.done and not observation:
        raise ValueError("step() returned no observation and done=False: the model would have nothing to answer")
    info = value.info
    if isinstance(info, Mapping) and "components" in info:
        info = {**info, "components": _checked_components(info["components"])}
    return StepResult(observation, float(value.reward), bool(value.done), info)


def _checked_components(parts: Any) -> dict[str, float]:
    """`step()`'s `info["components"]`: a mapping of names to finite numbers (ValueError naming the bad entry)."""
    if not isinstance(parts, Mapping):
        raise ValueError(f"step() info['components'] must map names to numbers, got {type(parts).__name__}")
    for name, part in parts.items():
        if not isinstance(name, str) or not isinstance(part, numbers.Real) or not math.isfinite(float(part)):
            raise ValueError(f"step() info['components'][{name!r}] must be a finite number, got {part!r}")
    return {name: float(part) for name, part in parts.items()}


class RewardFnEnvironment:
    """The single-turn adapter: a reward function `fn(completion, metadata)` as a one-step environment.

    reset -> the task's messages; step -> done, with the reward `common.tasks.total_reward` makes of what `fn`
    returned (its components are in `info["components"]`). A raising reward function raises out of `step`, which
    the driver records as `env_error: step: ...` with `env.failure_reward`: the rule of the generator's fast
    single-turn path too (`actors.rollouts`), whose reason reads `env_error: reward: ...`.
    """

    def __init__(self, reward_fn: Callable[[str, Mapping[str, Any]], Any]) -> None:
        self.reward_fn = reward_fn
        self.metadata: Mapping[str, Any] = {}

    def reset(self, task: Task) -> list[Message]:
        self.metadata = task.metadata
        return list(task.messages)

    def step(self, model_turn_text: str) -> StepResult:
        from common.tasks import total_reward

        reward, components = total_reward(self.reward_fn(model_turn_text, self.metadata))
        return StepResult([], reward=reward, done=True, info={"components": components})


def resolve_environment(spec: str, search_path: Sequence[str] = ()) -> Callable[..., Environment]:
    """The factory (usually a class) named by `"package.module:Name"`, imported from `search_path` (the resolved
    `env.plugin_paths`) first, then PYTHONPATH and the installed packages.

    Raises ImportError (saying where the module was searched), AttributeError or TypeError; every message names
    `env.environment` and the spec.
    """
    target = resolve_callable(spec, "env.environment", "package.module:Factory", "a class or factory", search_path)
    if isinstance(target, type) and not (hasattr(target, "reset") and hasattr(target, "step")):
        raise TypeError(f"env.environment: {spec!r}: class {target.__name__} needs reset(task) and step(text)")
    return target


def environment_factory(env: EnvConfig) -> EnvironmentFactory:
    """A zero-argument factory of one episode's environment: `env.environment(**env.environment_args)`, or, when
    `env.environment` is empty, the single-turn adapter around `env.reward_fn`. Resolves the names now (from
    `env.plugin_paths` first, see common.plugins), and calls the environment's `prepare(**environment_args)` if it
    has one, so a misnamed environment or reward function, or arguments the environment refuses, fail at start-up,
    not at the first episode. `"verifiers:<id>"` loads a verifiers environment (actors.environments.verifiers_env, resolved at
    run time by name: common/ imports no actors/ module)."""
    if not env.environment:
        from common.reward_routing import reward_fn_for

        reward_fn = reward_fn_for(env)
        return lambda: RewardFnEnvironment(reward_fn)
    if env.environment.startswith(VERIFIERS_PREFIX):  # a verifiers env: its loader lives with the actors
        load = resolve_callable(VERIFIERS_LOADER, "env.environment", "module:function", "a factory", env.plugin_paths)
        return load(env.environment.removeprefix(VERIFIERS_PREFIX), dict(env.environment_args))
    factory = resolve_environment(env.environment, env.plugin_paths)
    arguments = dict(env.environment_args)
    prepare = getattr(factory, "prepare", None)
    if callable(prepare):  # the environment's start-up check (see the module docstring): raising stops the start
        prepare(**arguments)

    def make() -> Environment:
        return factory(**arguments)

    make.process_metrics = getattr(factory, "process_metrics", None)  # type: ignore[attr-defined]
    return make
