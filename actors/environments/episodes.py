"""Multi-turn episodes on a continuously batching engine: many in flight, environments stepped off the engine loop.

    driver = EpisodeDriver(engine, environment_factory(config.env), EpisodeLimits.from_config(config),
                           EnvRunner(config.env.env_workers), group_size=config.algo.group_size)
    driver.start_group(lease_id, prompt)                  # the n episodes of one leased prompt
    while driver.active():
        for group in driver.advance(submit=True):         # env results in, next turns out, limits enforced
            outbox.add(build_episode_group(...))
        for sample in engine.step():                      # (only while engine.num_unfinished() > 0)
            driver.on_turn(sample)                        # a model turn finished: its env step is submitted

An episode, phase by phase (the generator's single thread drives it; env calls run in the `EnvRunner`):
  resetting   factory() (on the loop: keep it cheap), then reset(task) in the runner; the observation (with the
              tools block when the environment declares `tools`, see common.envs) is rendered with the chat template
              and the generation prompt: the episode's prompt tokens
  queued      waits for `advance(submit=True)` (the generator holds it while it drains the engine for weights)
  generating  one engine request: prompt = the whole token prefix, max_tokens = min(generator.max_tokens, room)
  stepping    step(text of the turn) in the runner; the observation becomes environment tokens (`render_turn`)
  -> queued again, or finished. The engine never waits for an environment: while one computes, the engine samples
  every other episode's turn.

Finish reasons, checked in this order after each call (limits never cut a running turn but the episode timeout):
  env_error: <what>   the factory, reset or step raised, or returned something malformed   (reward failure_reward)
  env_timeout         a reset or step call overran env.step_timeout_s                        (reward failure_reward)
  episode_timeout     env.episode_timeout_s passed; a running turn is aborted                (reward failure_reward)
  done | length       the step said done; `length` when that last turn was cut by its max_tokens (the generator's
                      limit or the episode's remaining budget)
  max_turns           env.max_turns model turns were taken and the environment wants another
  max_total_tokens    the next observation plus one model token does not fit env.max_total_tokens (completion
                      tokens) or model.max_model_len (prompt + completion); also a first observation that fills
                      the model's context
An observation that does not fit is not appended: a trajectory ends with a model turn, or with an observation the
model was then asked to answer (episode_timeout). Rewards: see `actors.environments.trajectory.EpisodeResult`.

Weights may change between two turns of an episode (the generator loads them when the engine has nothing running,
`submit=False` holding the queued turns meanwhile, or between steps with in-flight updates): every token carries the
version that sampled it, and a sample's version (what staleness is judged by) is its oldest.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.engine.api import Engine, FinishedSample
from actors.environments.runner import CallOutcome, EnvCall, EnvRunner
from actors.environments.trajectory import EpisodeResult, Trajectory
from common.config import TandemConfig
from common.envs import EnvironmentFactory, check_first_observation, check_step_result
from common.tool_calls import check_tools, with_tools
from common.types import PromptItem

# The driver's own reward components; a step's part of one of these names is not split out (it stays in terminal).
RESERVED_COMPONENTS = ("turn_reward_sum", "terminal", "failure")
log = logging.getLogger("tandem.actors.episodes")

FAILURE_PREFIXES = ("env_error", "env_timeout", "episode_timeout")
DEADLINE_CHECK_S = 0.05  # how often generating and queued episodes are checked against their deadline


@dataclass(frozen=True)
class EpisodeLimits:
    """The bounds of one episode (from `[env]`, `generator.max_tokens` and `model.max_model_len`)."""

    max_turns: int
    max_total_tokens: int
    turn_max_tokens: int
    max_model_len: int
    step_timeout_s: float
    episode_timeout_s: float
    failure_reward: float
    max_abs_reward: float = 1e6  # buffer.max_abs_reward: an episode earning more (or a non-finite reward) fails

    @classmethod
    def from_config(cls, config: TandemConfig) -> EpisodeLimits:
        env = config.env
        return cls(
            env.max_turns,
            env.max_total_tokens,
            config.generator.max_tokens,
            config.model.max_model_len,
            env.step_timeout_s,
            env.episode_timeout_s,
            env.failure_reward,
            config.buffer.max_abs_reward,
        )


@dataclass
class EpisodeGroup:
    """The `n` episodes of one leased prompt; `results[i]` is None until episode i finishes."""

    lease_id: int
    prompt: PromptItem
    started_at: float  # unix time
    results: list[EpisodeResult | None]

    @property
    def complete(self) -> bool:
        return all(r is not None for r in self.results)


@dataclass(eq=False)
class _Episode:
    group: EpisodeGroup
    index: int
    env: Any
    deadline: float  # monotonic
    start_version: int
    phase: str = "resetting"  # resetting | queued | generating | stepping | finished
    trajectory: Trajectory | None = None
    call: EnvCall | None = None
    request_id: str = ""
    turns: int = 0
    step_rewards: list[float] = field(default_factory=list)
    final_parts: dict[str, float] = field(default_factory=dict)  # the done step's info["components"] (common.envs)
    last_turn: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    truncated: bool = False

    @property
    def name(self) -> str:
        return f"{self.group.lease_id}:{self.group.prompt.prompt_id}:{self.index}"


class EpisodeStats:
    """Counters for `env/...` metrics: cumulative counts, and means over the interval since the last `drain`."""

    def __init__(self) -> None:
        self.episodes = self.failures = self.timeouts = 0
        self.turns: list[int] = []
        self.step_seconds: list[float] = []
        self.model_tokens = self.env_tokens = 0

    def drain(self, stuck_calls: int) -> dict[str, float]:
        values = {
            "env/episodes": self.episodes,
            "env/failures": self.failures,
            "env/timeouts": self.timeouts,
            "env/failure_rate": (self.failures + self.timeouts) / max(self.episodes, 1),
            "env/turns_mean": float(np.mean(self.turns)) if self.turns else 0.0,
            "env/step_s_mean": float(np.mean(self.step_seconds)) if self.step_seconds else 0.0,
            "env/env_tokens_frac": self.env_tokens / max(self.env_tokens + self.model_tokens, 1),
            "env/stuck_calls": stuck_calls,
        }
        self.turns, self.step_seconds = [], []
        return values


class EpisodeDriver:
    """Runs episodes turn by turn on `engine` (see the module docstring). One driver thread."""

    def __init__(
        self,
        engine: Engine,
        factory: EnvironmentFactory,
        limits: EpisodeLimits,
        runner: EnvRunner,
        group_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine, self.factory, self.limits, self.runner = engine, factory, limits, runner
        self.group_size = group_size
        self.clock = clock
        self.groups: dict[tuple[int, int], EpisodeGroup] = {}
        self.calling: dict[int, _Episode] = {}  # id(episode) -> episode with an env call running
        self._answered: deque[_Episode] = deque()  # episodes whose call is done (appended by the runner's thread)
        self.calls_answered = 0  # environment calls taken in so far: progress, for the generator's heartbeat
        self._next_deadline_check = 0.0
        self.requests: dict[str, _Episode] = {}  # engine request id -> episode generating
        self.queued: deque[_Episode] = deque()
        self.live: dict[int, _Episode] = {}
        self.stats = EpisodeStats()
        self._complete: list[EpisodeGroup] = []

    # ------------------------------------------------------------------------------------------------ interface
    def start_group(self, lease_id: int, prompt: PromptItem) -> None:
        """Open the `group_size` episodes of a prompt; their resets start now."""
        group = EpisodeGroup(lease_id, prompt, time.time(), [None] * self.group_size)
        self.groups[(lease_id, prompt.prompt_id)] = group
        for index in range(self.group_size):
            self._open(group, index)

    def on_turn(self, sample: FinishedSample) -> None:
        """A model turn finished: append it exactly as sampled, give its token counts to the environment's optional
        `on_model_turn` (common.envs) and submit the environment's step on its text.
        Samples of requests this driver does not track (aborted, or another caller's) are ignored."""
        episode = self.requests.pop(sample.request_id, None)
        if episode is None:
            return
        prompt_tokens = episode.trajectory.context_length  # the whole context the model was given for this turn
        episode.trajectory.add_model_turn(sample)
        episode.turns += 1
        episode.truncated = sample.finish_reason == "length"
        episode.last_turn = sample.completion_tokens
        self.stats.model_tokens += len(sample.completion_tokens)
        note = getattr(episode.env, "on_model_turn", None)  # optional (common.envs): the turn's counts, before step
        if callable(note):
            try:
                note(prompt_tokens, len(sample.completion_tokens), sample.finish_reason)
            except BaseException as error:  # noqa: BLE001 - user code, SystemExit & co. too: the episode fails
                self._finish(episode, f"env_error: on_model_turn: {type(error).__name__}: {error}"[:300])
                return
        self._call(episode, "stepping", episode.env.step, self.engine.decode(sample.completion_tokens))

    def advance(self, submit: bool = True) -> list[EpisodeGroup]:
        """Take in finished env calls, enforce the episode timeout, and (when `submit`) add the queued turns to
        the engine. Returns the groups whose episodes have all finished (each once)."""
        now = self.clock()
        while self._answered:
            episode = self._answered.popleft()
            del self.calling[id(episode)]
            self.calls_answered += 1
            outcome = episode.call.outcome()
            if episode.phase == "resetting":
                self._on_reset(episode, outcome, now)
            else:
                self.stats.step_seconds.append(outcome.seconds)
                self._on_step(episode, outcome, now)
        self._enforce_deadlines(now)
        while submit and self.queued:
            episode = self.queued.popleft()
            if episode.phase == "queued":
                self._submit(episode)
        complete, self._complete = self._complete, []
        return complete

    def active(self) -> bool:
        """Some episode has not finished, or a finished group has not been returned by `advance` yet."""
        return bool(self.groups or self._complete)

    def wait(self, timeout_s: float) -> None:
        """Sleep until an environment call finishes, or `timeout_s` (the loop's idle wait when the engine is empty)."""
        self.runner.wait(timeout_s)

    def request_ids(self) -> list[str]:
        """Engine requests of the turns being generated (what to abort on shutdown)."""
        return list(self.requests)

    def metrics(self) -> dict[str, float]:
        runner = self.runner
        blocks = {"env/loop_blocks": runner.loop_blocks, "env/loop_blocked_s": runner.loop_blocked_s}
        values = {**self.stats.drain(runner.stuck_calls), **blocks, "env/loop_escapes": runner.loop_escapes}
        process_metrics = getattr(self.factory, "process_metrics", None)  # common.envs: the environment's own
        if callable(process_metrics):
            try:
                values.update(process_metrics())
            except Exception:  # a plug-in's counters: never worth the generator's report
                log.exception("the environment's process_metrics() failed; its metrics are left out")
        return values

    def close(self) -> None:
        """Stop the environment runner (environment calls still running are abandoned)."""
        self.runner.close()

    # ---------------------------------------------------------------------------------------------- phases
    def _open(self, group: EpisodeGroup, index: int) -> None:
        now = self.clock()
        episode = _Episode(group, index, None, now + self.limits.episode_timeout_s, self.engine.policy_version)
        self.live[id(episode)] = episode
        try:
            episode.env = self.factory()
        except BaseException as error:  # noqa: BLE001 - user code, SystemExit & co. too: the episode fails
            self._finish(episode, f"env_error: factory: {type(error).__name__}: {error}"[:300])
            return
        self._call(episode, "resetting", episode.env.reset, group.prompt)

    def _call(self, episode: _Episode, phase: str, fn: Callable[..., Any], argument: Any) -> None:
        timeout = min(self.limits.step_timeout_s, episode.deadline - self.clock())
        episode.phase, episode.call = phase, self.runner.call(fn, argument, timeout_s=timeout)
        self.calling[id(episode)] = episode
        episode.call.on_done(lambda: self._answered.append(episode))  # deque.append is thread-safe

    def _checked(
        self, episode: _Episode, outcome: CallOutcome, now: float, what: str, check: Callable[[Any], Any]
    ) -> Any | None:
        """`check(value)` of a call that returned in time; None once the episode is finished because the call
        raised, overran, or returned something `check` rejects."""
        if outcome.timed_out:
            self._finish(episode, "episode_timeout" if now >= episode.deadline else "env_timeout")
            return None
        error = outcome.error
        if error is None:
            try:
                return check(outcome.value)
            except (TypeError, ValueError) as rejected:
                error = rejected
        self._finish(episode, f"env_error: {what}: {error}"[:300])
        return None

    def _on_reset(self, episode: _Episode, outcome: CallOutcome, now: float) -> None:
        messages = self._checked(episode, outcome, now, "reset", lambda value: _first_chat(episode.env, value))
        if messages is None:
            return
        tokens = self.engine.render(dataclasses.replace(episode.group.prompt, messages=messages))
        episode.trajectory = Trajectory(tokens)
        if len(tokens) + 1 > self.limits.max_model_len:
            log.error(
                "episode %s: first observation has %d tokens, model.max_model_len is %d (raise it)",
                episode.name,
                len(tokens),
                self.limits.max_model_len,
            )
            self._finish(episode, "max_total_tokens")
            return
        self._queue(episode)

    def _on_step(self, episode: _Episode, outcome: CallOutcome, now: float) -> None:
        result = self._checked(episode, outcome, now, "step", check_step_result)
        if result is None:
            return
        episode.step_rewards.append(result.reward)
        if result.done:
            episode.final_parts = result.info.get("components", {}) if isinstance(result.info, dict) else {}
            self._finish(episode, "length" if episode.truncated else "done")
            return
        if episode.turns >= self.limits.max_turns:
            self._finish(episode, "max_turns")
            return
        try:
            tokens = self.engine.render_turn(episode.last_turn, result.observation)
        except Exception as error:  # noqa: BLE001 - the chat template rejected the environment's messages (e.g. an unknown role)
            self._finish(episode, f"env_error: render: {type(error).__name__}: {error}"[:300])
            return
        trajectory = episode.trajectory
        if (
            trajectory.num_tokens + len(tokens) + 1 > self.limits.max_total_tokens
            or trajectory.context_length + len(tokens) + 1 > self.limits.max_model_len
        ):
            self._finish(episode, "max_total_tokens")
            return
        trajectory.add_environment(tokens)
        self.stats.env_tokens += len(tokens)
        self._queue(episode)

    def _queue(self, episode: _Episode) -> None:
        episode.phase = "queued"
        self.queued.append(episode)

    def _submit(self, episode: _Episode) -> None:
        trajectory, limits = episode.trajectory, self.limits
        room = min(
            limits.turn_max_tokens,
            limits.max_total_tokens - trajectory.num_tokens,
            limits.max_model_len - trajectory.context_length,
        )
        episode.request_id = f"{episode.name}:{episode.turns}"
        episode.phase = "generating"
        self.requests[episode.request_id] = episode
        self.engine.add(episode.request_id, trajectory.context(), max_tokens=room)

    def _enforce_deadlines(self, now: float) -> None:
        """Queued or generating episodes past their deadline end (checked every DEADLINE_CHECK_S; env calls carry
        the deadline themselves)."""
        if now < self._next_deadline_check:
            return
        self._next_deadline_check = now + DEADLINE_CHECK_S
        expired = [e for e in self.live.values() if e.phase in ("queued", "generating") and now >= e.deadline]
        for episode in expired:
            if episode.phase == "generating":
                self.engine.abort([episode.request_id])
                del self.requests[episode.request_id]
            self._finish(episode, "episode_timeout")

    def _finish(self, episode: _Episode, reason: str) -> None:
        """Record the episode's result. A reward the buffer would refuse (non-finite, or beyond max_abs_reward in
        any component or in total) makes it an `env_error` with the failure reward: one environment's overflowing
        reward must not get the whole group, its other samples with it, rejected at the buffer."""
        episode.phase = "finished"
        self.live.pop(id(episode), None)
        components = None if reason.startswith(FAILURE_PREFIXES) else _earned(episode, reason)
        problem = "" if components is None else _out_of_range(components, self.limits.max_abs_reward)
        if problem:
            reason = f"env_error: {problem}"[:300]
        if components is None or problem:
            components = {"turn_reward_sum": 0.0, "terminal": 0.0, "failure": self.limits.failure_reward}
            log.warning(
                "episode %s ended %s after %d turns: reward %.3f",
                episode.name,
                reason,
                episode.turns,
                self.limits.failure_reward,
            )
        self._count(reason, episode.turns)
        if episode.trajectory is None:  # it ended before its first observation: the task's own chat is the prompt
            episode.trajectory = Trajectory(self.engine.render(episode.group.prompt))
        close = getattr(episode.env, "close", None)
        if callable(close):
            self.runner.call(close, timeout_s=self.limits.step_timeout_s)  # not waited for; a failure is harmless
        group = episode.group
        group.results[episode.index] = EpisodeResult(
            episode.trajectory, episode.start_version, reason, episode.turns, components
        )
        if group.complete:
            del self.groups[(group.lease_id, group.prompt.prompt_id)]
            self._complete.append(group)

    def _count(self, reason: str, turns: int) -> None:
        self.stats.episodes += 1
        self.stats.turns.append(turns)
        if reason.startswith("env_error"):
            self.stats.failures += 1
        elif reason in ("env_timeout", "episode_timeout"):
            self.stats.timeouts += 1


def _first_chat(env: Any, observation: Any) -> list[dict[str, Any]]:
    """The first observation, checked, with the Hermes tools block (common.tool_calls) in its system message when
    the environment declares `tools`; TypeError/ValueError (-> env_error) for a bad observation or tool list."""
    messages = check_first_observation(observation)
    tools = getattr(env, "tools", None)
    return with_tools(messages, check_tools(tools)) if tools else messages


def _earned(episode: _Episode, reason: str) -> dict[str, float]:
    """The reward components of an episode that ended without failing (see actors.environments.trajectory.EpisodeResult)."""
    terminal = episode.step_rewards[-1] if reason in ("done", "length") else 0.0
    before = episode.step_rewards[:-1] if reason in ("done", "length") else episode.step_rewards
    parts = {name: part for name, part in episode.final_parts.items() if name not in RESERVED_COMPONENTS}
    # The done step's named parts (a rubric's) stand beside `terminal`, which keeps what they leave of its reward,
    # so the components still sum to the episode's reward.
    return {
        "turn_reward_sum": float(sum(before)),
        "terminal": float(terminal - sum(parts.values())),
        **parts,
        "failure": 0.0,
    }


def _out_of_range(components: dict[str, float], bound: float) -> str:
    """What is wrong with these reward components for the buffer ('' when nothing): each and their sum must be
    finite and within [-bound, bound] (buffer.max_abs_reward)."""
    total = sum(components.values())
    for name, value in [*components.items(), ("total", total)]:
        if not math.isfinite(value) or abs(value) > bound:
            return f"reward {name} {value:g} outside [-{bound:g}, {bound:g}] (buffer.max_abs_reward)"
    return ""
