"""Fakes beside the multi-turn tests: a scripted engine with a real chat template, and scripted environments.

    engine = ScriptedEngine(tokenizer, seed=0, eos_probability=0.3)    # random turns, every request recorded
    envs = scripted_factory([[Turn(obs="higher"), Turn(done=True, reward=1.0)], ...])   # one script per episode
    driver = EpisodeDriver(engine, envs, limits, EnvRunner(8), group_size=2)

The engine samples random token ids (never special tokens, except the end-of-turn token it may end a turn with)
and records every request's prompt and sampled tokens, so a test can check the trajectories token by token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.engine.api import FinishedSample
from actors.environments.chat_turns import TokenizerTexts
from actors.weights.updates import WeightsUpdate
from common.envs import StepResult

FIRST_ORDINARY_TOKEN = 100  # SmolLM2's special tokens are ids 0..16


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    max_tokens: int
    length: int
    ends_turn: bool
    start_version: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class ScriptedEngine(TokenizerTexts):
    """The `Engine` interface over a real tokenizer's chat template; one random token per running request a step.

    A request ends after a random length in [1, max_tokens]; with `eos_probability` its last token is the
    end-of-turn token (finish "stop"), else it runs to its length ("length" when that is its max_tokens).
    `policy_version` may be changed between steps by the test: later tokens carry the new version.
    """

    def __init__(
        self, tokenizer: Any, seed: int = 0, eos_probability: float = 0.3, max_tokens: int = 8, step_s: float = 0.0
    ) -> None:
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)
        self.eos_probability = eos_probability
        self.max_tokens = max_tokens
        self.step_s = step_s
        self.policy_version = 0
        self.running: dict[str, _Request] = {}
        self.requests: dict[str, _Request] = {}  # every request ever added, by id
        self.steps = 0

    def add(self, request_id: str, prompt_tokens: list[int], max_tokens: int | None = None) -> None:
        limit = self.max_tokens if max_tokens is None else max_tokens
        assert limit >= 1, f"{request_id}: max_tokens {limit}"
        length = int(self.rng.integers(1, limit + 1))
        ends = bool(self.rng.random() < self.eos_probability)
        request = _Request(request_id, list(prompt_tokens), limit, length, ends, self.policy_version)
        self.running[request_id] = request
        self.requests[request_id] = request

    def num_unfinished(self) -> int:
        return len(self.running)

    def step(self) -> list[FinishedSample]:
        if self.step_s:
            time.sleep(self.step_s)
        self.steps += 1
        finished = []
        for request in list(self.running.values()):
            last = len(request.tokens) + 1 == request.length
            if last and request.ends_turn:
                token = self.turns.end_of_turn_id()
            else:
                token = int(self.rng.integers(FIRST_ORDINARY_TOKEN, len(self.tokenizer)))
            request.tokens.append(token)
            request.logprobs.append(float(-self.rng.exponential(3.0)))
            request.versions.append(self.policy_version)
            if last:
                del self.running[request.request_id]
                reason = "stop" if request.ends_turn else ("length" if request.length == request.max_tokens else "stop")
                finished.append(
                    FinishedSample(
                        request.request_id,
                        np.asarray(request.tokens, np.int32),
                        np.asarray(request.logprobs, np.float32),
                        np.asarray(request.versions, np.int32),
                        reason,
                        request.start_version,
                    )
                )
        return finished

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.running.pop(request_id, None)

    def load_weights(self, update: WeightsUpdate, inflight: bool) -> None:
        self.policy_version = update.policy_version

    def shutdown(self) -> None:
        self.running.clear()


@dataclass(frozen=True)
class Turn:
    """What a scripted environment does on one step: answer `obs` (a user message), or end (`done`), raise,
    sleep first (`sleep_s`; `async_sleep` to sleep in an `async def`), or return garbage."""

    obs: str = "ok"
    reward: float = 0.0
    done: bool = False
    raises: bool = False
    sleep_s: float = 0.0
    garbage: bool = False


class ScriptedEnv:
    """Plays `script`, one `Turn` per step; records what it was given. reset answers the task's messages, or
    `first` (a user message) when given."""

    def __init__(self, script: list[Turn], first: str | None = None, reset_raises: bool = False) -> None:
        self.script = list(script)
        self.first = first
        self.reset_raises = reset_raises
        self.texts: list[str] = []
        self.observations: list[list[dict[str, str]]] = []
        self.closed = False

    def reset(self, task: Any) -> list[dict[str, str]]:
        if self.reset_raises:
            raise RuntimeError("reset exploded")
        return [{"role": "user", "content": self.first}] if self.first is not None else list(task.messages)

    def _next_turn(self) -> Turn:
        return self.script[min(len(self.texts), len(self.script) - 1)]

    def step(self, model_turn_text: str) -> Any:
        turn = self._next_turn()
        if turn.sleep_s:
            time.sleep(turn.sleep_s)
        return self._respond(turn, model_turn_text)

    def _respond(self, turn: Turn, text: str) -> Any:
        self.texts.append(text)
        if turn.raises:
            raise RuntimeError("step exploded")
        if turn.garbage:
            return {"observation": "not a StepResult"}
        observation = [] if turn.done else [{"role": "user", "content": turn.obs}]
        self.observations.append(observation)
        return StepResult(observation, reward=turn.reward, done=turn.done)

    def close(self) -> None:
        self.closed = True


class AsyncScriptedEnv(ScriptedEnv):
    """The same, with `async def` methods (sleeping with asyncio)."""

    async def reset(self, task: Any) -> list[dict[str, str]]:  # type: ignore[override]
        await asyncio.sleep(0)
        return ScriptedEnv.reset(self, task)

    async def step(self, model_turn_text: str) -> Any:  # type: ignore[override]
        turn = self._next_turn()
        if turn.sleep_s:
            await asyncio.sleep(turn.sleep_s)
        return self._respond(turn, model_turn_text)


class ScriptedFactory:
    """An environment factory handing out one scripted environment per episode, in order; keeps them all."""

    def __init__(self, envs: Iterator[ScriptedEnv] | list[ScriptedEnv]) -> None:
        self._envs = iter(envs)
        self.made: list[ScriptedEnv] = []

    def __call__(self) -> ScriptedEnv:
        env = next(self._envs)
        self.made.append(env)
        return env


class BadPluginEnv(ScriptedEnv):
    """An async environment whose step misbehaves as `how` says: raise `exit` (SystemExit), `interrupt`
    (KeyboardInterrupt), `generator_exit`, `custom` (a BaseException subclass), `in_task` (SystemExit in a task it
    started itself), or `block` (time.sleep(block_s) inside `async def step`: holds the event loop)."""

    def __init__(self, how: str, block_s: float = 2.0) -> None:
        super().__init__([Turn(done=True, reward=1.0)])
        self.how, self.block_s = how, block_s

    async def step(self, model_turn_text: str) -> Any:  # type: ignore[override]
        misbehave(self.how, self.block_s)
        if self.how == "in_task":
            await asyncio.get_running_loop().create_task(_exit_in_task())
        return self._respond(self._next_turn(), model_turn_text)


class CustomBaseError(BaseException):
    """A plug-in's own BaseException subclass."""


def misbehave(how: str, block_s: float) -> None:
    """Raise or block as `BadPluginEnv` documents (nothing for another `how`)."""
    errors = {
        "exit": SystemExit(3),
        "interrupt": KeyboardInterrupt("interrupted"),
        "generator_exit": GeneratorExit("closed"),
        "custom": CustomBaseError("custom"),
    }
    if how in errors:
        raise errors[how]
    if how == "block":
        time.sleep(block_s)  # the bug being survived: a blocking call inside async code


async def _exit_in_task() -> None:
    raise SystemExit(4)


# ---------------------------------------------------------------------------- environments for the generator process
class TwoTurnEnv:
    """For `tandem generator` tests: asks for a second turn, then ends with reward 1. Prompts whose metadata has
    `explode` raise in step; `slow` ones sleep for two minutes (stuck, as far as a test can tell)."""

    def reset(self, task: Any) -> list[dict[str, str]]:
        self.metadata = task.metadata
        self.turns = 0
        return list(task.messages)

    def step(self, model_turn_text: str) -> StepResult:
        self.turns += 1
        if self.metadata.get("explode"):
            raise RuntimeError(f"environment exploded on prompt {self.metadata['answer']}")
        if self.metadata.get("slow"):
            time.sleep(120.0)
        if self.turns == 1:
            return StepResult([{"role": "user", "content": "Are you sure? Check again."}], reward=0.25)
        return StepResult([], reward=1.0, done=True)


class PolicyEngine(ScriptedEngine):
    """A scripted engine whose turns are written by `policy(conversation text so far) -> reply`: the reply's tokens
    plus the end-of-turn token, all returned at the next step (log-probs 0). For playing an environment well."""

    def __init__(self, tokenizer: Any, policy: Any) -> None:
        super().__init__(tokenizer)
        self.policy = policy

    def add(self, request_id: str, prompt_tokens: list[int], max_tokens: int | None = None) -> None:
        reply = self.tokenizer.encode(self.policy(self.tokenizer.decode(prompt_tokens)), add_special_tokens=False)
        tokens = (reply + [self.turns.end_of_turn_id()])[: max_tokens or self.max_tokens]
        request = _Request(
            request_id,
            list(prompt_tokens),
            max_tokens or self.max_tokens,
            len(tokens),
            True,
            self.policy_version,
            tokens,
            [0.0] * len(tokens),
            [self.policy_version] * len(tokens),
        )
        self.running[request_id] = request
        self.requests[request_id] = request

    def step(self) -> list[FinishedSample]:
        finished = [
            FinishedSample(
                r.request_id,
                np.asarray(r.tokens, np.int32),
                np.zeros(len(r.tokens), np.float32),
                np.asarray(r.versions, np.int32),
                "stop",
                r.start_version,
            )
            for r in self.running.values()
        ]
        self.running.clear()
        return finished


class AsyncTwoTurnEnv(TwoTurnEnv):
    """TwoTurnEnv with an `async def step` that misbehaves on prompts whose metadata names `plugin_fault`
    (`misbehave`: exit, interrupt, block for `block_s`)."""

    async def step(self, model_turn_text: str) -> StepResult:  # type: ignore[override]
        misbehave(self.metadata.get("plugin_fault", ""), float(self.metadata.get("block_s", 5.0)))
        return TwoTurnEnv.step(self, model_turn_text)
