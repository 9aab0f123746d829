"""Stopping a generator whose reward function (or environment) fails on most samples, instead of training on
`env.failure_reward`.

    rollouts = GuardedRollouts(make(engine), FailureGuard(config.env.stop_failure_share))   # actors.rollouts does it
    for group in rollouts.finished(now): ...     # raises RewardsFailing once the guard trips

A sample whose reward cannot be had keeps its tokens and gets `env.failure_reward` (actors.rollouts): one sample
that trips a reward function is survived. A reward function that raises on MOST samples is a bug, not bad luck (a
GSM8K row's `#### 72` solution under the arithmetic reward, which wants a number, raises on every sample): training
on the fallback teaches nothing while every metric looks like a run that merely does not learn. So the generator
stops with the first error and its prompt, and `tandem run` stops the run with that line (launch/local.py: a role
that exits non-zero stops the others).

Where the line is:
  * A failure is a sample whose finish reason starts with `env_error` (the reward function or endpoint raised,
    timed out or returned garbage; a multi-turn environment raised or broke its contract). Environment timeouts
    (`env_timeout`, `episode_timeout`) are not counted: a slow tool is a cost, not a bug.
  * Judged over the last WINDOW_SAMPLES samples, once at least MIN_SAMPLES have been scored; the guard trips when
    the failed share of the window exceeds `share` (env.stop_failure_share, 0.5: "most"; 1.0 never trips).
  * Why MIN_SAMPLES = 64: a function that fails on 10% of samples (a few pathological completions) has, over 64
    samples, a mean of 6.4 failures and a standard deviation of 2.4; tripping needs 33, eleven deviations out, so a
    tolerable function never stops the run by chance. A function that fails on every sample stops after 64 samples
    (8 groups of 8: the run's first minute on a CPU), before the learner has trained on many of them.
  * Why WINDOW_SAMPLES = 512: a function that starts failing mid-run (a reward endpoint that went away) is caught
    within a window's worth of samples, and a short burst of failures (fewer than 257 in a row) is survived.
The launcher's first check (`tandem config`, launch/config_checks.py) scores the first rows before anything starts
and refuses a function that raises on all of them, which catches the common case sooner still.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from actors.engine.api import Engine, FinishedSample
from common.types import PromptItem, RolloutGroup

if TYPE_CHECKING:
    from actors.rollouts import Rollouts

log = logging.getLogger("tandem.actors.failure_guard")

MIN_SAMPLES = 64
WINDOW_SAMPLES = 512
FAILURE_PREFIX = "env_error"


class RewardsFailing(RuntimeError):
    """The reward function (or environment) failed on most recent samples: the generator stops."""


class FailureGuard:
    """Counts failed samples over a sliding window and trips past `share` (module docstring)."""

    def __init__(self, share: float, min_samples: int = MIN_SAMPLES, window: int = WINDOW_SAMPLES) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {share}")
        self.share, self.min_samples = share, min_samples
        self.recent: deque[bool] = deque(maxlen=window)
        self.failed_in_window = 0
        self.failed = 0
        self.seen = 0

    def check(self, group: RolloutGroup) -> None:
        """Count the group's samples; raise RewardsFailing (with the first failure's reason and the prompt id)
        when the window's failed share is past the line."""
        for reason in group.finish_reasons:
            failed = reason.startswith(FAILURE_PREFIX)
            if len(self.recent) == self.recent.maxlen:
                self.failed_in_window -= self.recent[0]
            self.recent.append(failed)
            self.failed_in_window += failed
            self.failed += failed
            self.seen += 1
        if len(self.recent) < self.min_samples or self.failed_in_window <= self.share * len(self.recent):
            return
        reasons = [r for r in group.finish_reasons if r.startswith(FAILURE_PREFIX)]
        reason = reasons[0] if reasons else "(none in this group; the earlier ones failed)"
        raise RewardsFailing(
            f"the reward failed on {self.failed_in_window} of the last {len(self.recent)} samples (more than "
            f"env.stop_failure_share = {self.share:g}), e.g. prompt {group.prompt_id}: {reason[:300]}; fix the "
            "reward function or the dataset's fields it reads (env.reward_fn, env.label_key; docs/datasets.md)"
        )


class GuardedRollouts:
    """A `actors.rollouts.Rollouts` whose finished groups pass a `FailureGuard` first; everything else is the
    wrapped rollouts'. Adds `actor/reward_failed_samples` to its metrics."""

    def __init__(self, rollouts: Rollouts, guard: FailureGuard) -> None:
        self.rollouts, self.guard = rollouts, guard

    def start(self, lease_id: int, prompt: PromptItem) -> bool:
        return self.rollouts.start(lease_id, prompt)

    def on_sample(self, sample: FinishedSample) -> None:
        self.rollouts.on_sample(sample)

    def advance(self, submit: bool) -> None:
        self.rollouts.advance(submit)

    def finished(self, now: float) -> list[RolloutGroup]:
        groups = self.rollouts.finished(now)
        for group in groups:
            self.guard.check(group)
        return groups

    def active(self) -> bool:
        return self.rollouts.active()

    def background(self) -> bool:
        return self.rollouts.background()

    def wait(self, timeout_s: float) -> None:
        self.rollouts.wait(timeout_s)

    def request_ids(self) -> list[str]:
        return self.rollouts.request_ids()

    def metrics(self) -> dict[str, float]:
        return {**self.rollouts.metrics(), "actor/reward_failed_samples": self.guard.failed}

    def progress(self) -> int:
        return self.rollouts.progress()

    def close(self) -> None:
        self.rollouts.close()


def guarded(make_rollouts: Callable[[Engine], Rollouts], share: float) -> Callable[[Engine], Rollouts]:
    """`make_rollouts` whose rollouts are guarded by a FailureGuard at `share` (1.0: unguarded)."""
    if share >= 1.0:
        return make_rollouts

    def make(engine: Engine) -> Rollouts:
        return GuardedRollouts(make_rollouts(engine), FailureGuard(share))

    return make
