"""Scoring completions: the configured reward function, or an HTTP endpoint when `env.reward_url` is set.

    scorer = RewardScorer(config.env)
    score = scorer.score(completion_text, prompt.metadata)   # never raises for a faulty reward
    score.reward, score.components, score.error

HTTP protocol: POST `{"completion": str, "metadata": {...}}` as JSON to `reward_url`; the answer is
`{"reward": float, "components": {name: float}}` (components optional), within `reward_timeout_s`.

Failure mode (deliberately survived): a reward function that raises (any BaseException) or runs past
`env.reward_timeout_s`, an endpoint that fails, times out or answers garbage, or a non-finite reward gives the sample
`env.failure_reward` and no components; `score.error` says what happened, `errors` counts it (`timeouts` the calls
that ran too long), and it is logged. The generator stays up.

A reward function runs on a worker thread of its own (`TimedFunction`, also used by evaluation's scoring), so one that
blocks (an infinite loop, a hung network call) cannot hold the generator's loop: past the timeout its call is
abandoned (a Python thread cannot be killed; it is left to finish, counted in `timeouts`) and the next call gets a
fresh worker. Past `MAX_ABANDONED` abandoned workers still running, calls fail at once with the reason, rather than
pile up threads. Off the main thread, a reward function must not use signals (`signal.alarm`).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import queue
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.config import EnvConfig

log = logging.getLogger("tandem.actors.rewards")
MAX_ABANDONED = 8  # reward calls past their timeout still running on their threads, at most


class TimedFunction:
    """`function(*args)` on a daemon worker thread of its own, within `timeout_s` (see the module docstring): past it
    the call raises TimeoutError and is abandoned (`timeouts`), the next call gets a fresh worker, and past
    MAX_ABANDONED abandoned calls still running every call raises at once. Whatever the function raises (any
    BaseException) is raised to the caller. Daemon threads: a call that never returns does not hold the process's
    exit. One caller thread."""

    def __init__(self, function: Callable[..., Any], timeout_s: float, setting: str) -> None:
        self.function, self.timeout_s, self.setting = function, timeout_s, setting
        self.timeouts = 0
        self._abandoned: list[threading.Thread] = []
        self._jobs: queue.SimpleQueue | None = None  # the current worker's (None: start one at the next call)
        self._thread: threading.Thread | None = None

    def __call__(self, *args: Any) -> Any:
        self._abandoned = [thread for thread in self._abandoned if thread.is_alive()]
        if len(self._abandoned) >= MAX_ABANDONED:
            raise TimeoutError(
                f"{len(self._abandoned)} earlier calls of the function are still running past {self.setting} = "
                f"{self.timeout_s:g}s: it blocks; fix it or raise the timeout"
            )
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=_serve, args=(self.function, self._jobs), daemon=True)
            self._thread.name = "reward-fn"
            self._thread.start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, args))
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            self.timeouts += 1
            self._abandoned.append(self._thread)
            self.close()  # the blocked worker leaves once (if ever) its call returns
            raise TimeoutError(f"the function ran past {self.setting} = {self.timeout_s:g}s") from None

    def close(self) -> None:
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = self._thread = None


def _serve(function: Callable[..., Any], jobs: queue.SimpleQueue) -> None:
    """A TimedFunction's worker: run each job's call and settle its future, until a None job."""
    while (job := jobs.get()) is not None:
        future, args = job
        try:
            future.set_result(function(*args))
        except BaseException as error:  # noqa: BLE001 - handed to the caller, whatever it is
            future.set_exception(error)


@dataclass(frozen=True)
class Score:
    reward: float
    components: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # "ValueError: ..." when the reward fell back to `env.failure_reward`


class RewardScorer:
    """Scores one completion at a time with the configured function or endpoint (see the module docstring)."""

    def __init__(self, env: EnvConfig) -> None:
        from common.reward_routing import reward_fn_for
        from common.tasks import total_reward

        self.env = env
        self.errors = 0
        self._total_reward = total_reward
        self._function: TimedFunction | None = None
        if not env.reward_url:
            function = reward_fn_for(env)  # env.reward_fn, or by the row's data_source (common/reward_routing.py)
            self._function = TimedFunction(function, env.reward_timeout_s, "env.reward_timeout_s")

    def score(self, completion: str, metadata: dict[str, Any]) -> Score:
        try:
            if self._function is not None:
                reward, components = self._total_reward(self._function(completion, metadata))
            else:
                reward, components = self._post(completion, metadata)
            reward = float(reward)
            components = {str(name): float(value) for name, value in components.items()}
            if not math.isfinite(reward) or not all(math.isfinite(v) for v in components.values()):
                raise ValueError(f"reward {reward} or components {components} are not finite")
        except BaseException as error:  # noqa: BLE001 - a user reward function may raise anything, SystemExit and
            # KeyboardInterrupt too (the generator takes its signals by handler, so none is a real Ctrl-C): fall back
            self.errors += 1
            message = f"{type(error).__name__}: {error}"[:300]
            fallback = self.env.failure_reward
            log.warning("reward failed (%d so far), using fallback %.3f: %s", self.errors, fallback, message)
            return Score(fallback, {}, message)
        return Score(reward, components)

    @property
    def timeouts(self) -> int:
        return self._function.timeouts if self._function is not None else 0

    def close(self) -> None:
        """Let the worker go (an abandoned call is left to finish on its own thread)."""
        if self._function is not None:
            self._function.close()

    def _post(self, completion: str, metadata: dict[str, Any]) -> tuple[float, dict[str, float]]:
        body = json.dumps({"completion": completion, "metadata": metadata}).encode()
        request = urllib.request.Request(
            self.env.reward_url, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=self.env.reward_timeout_s) as response:
            answer = json.loads(response.read())
        if not isinstance(answer, dict) or "reward" not in answer:
            raise ValueError(f"reward endpoint answered {str(answer)[:100]!r}, expected {{'reward': float, ...}}")
        components = answer.get("components") or {}
        if not isinstance(components, dict):
            raise ValueError(f"reward endpoint 'components' must be a map, got {type(components).__name__}")
        return answer["reward"], components
