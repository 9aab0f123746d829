"""Dynamic sampling (DAPO): with `buffer.filter = "no_signal"` the buffer drops, at arrival, every group whose rewards
carry no signal, and admission leases enough extra prompts that the learner's batches still fill.

    if no_signal(group.rewards, settings.min_reward_spread): state.filter_out(group, now)  # dropped_no_signal
    keep = window.keep(settings.max_filtered_share)             # the share of arrivals expected to carry signal
    quota = signal_quota(v, η, B, trained + buffered, outstanding, keep)   # prompts a generator may still start

Why: GRPO's advantage of a sample is its reward minus its group's mean (over the group's std). A group whose rewards
are all equal gives every sample an advantage of 0: it teaches nothing, yet takes a learner step's share.

The rule (`no_signal`): a group carries no signal when

    max(r) - min(r) <= min_reward_spread + SPREAD_ULPS * ε32 * max|r|          (in float64, ε32 = 2**-23)

Rewards travel as float32 and the spread of two float32 values is exact in float64, so with min_reward_spread = 0
the left side is 0 only for bitwise-equal rewards. The tolerance covers rewards that are equal in exact arithmetic
but were summed from components in float32: each addition rounds by at most ε32/2 of its partial sum, so two such
sums of c non-negative components (partial sums <= |r|) differ by at most (c - 1)·ε32·max|r|; SPREAD_ULPS = 4 covers
c <= 5. The advantage such a spread would carry is noise amplified by the std normalisation. Components that cancel
(partial sums above |r|) need an explicit buffer.min_reward_spread.

Admission (`signal_quota`). `buffers.staleness.admit` lets a generator at version v start prompts while
trained + buffered + outstanding < (v + η + 1)·B. A filtered group leaves no trace in that count (like a dropped or
rejected one), so its quota reopens when it arrives, but only then: with a share f filtered, every prompt in flight
is only (1 - f) of a group the learner will train, and the learner would wait for rounds of re-leasing. So with the
filter on, outstanding prompts are counted at `keep` = 1 - f̂ each, f̂ the filtered share of the last
`buffer.filter_window` arrivals (0 before the first): a generator may hold up to
⌊((v + η + 1)·B - trained - buffered) / keep⌋ prompts outstanding, the expected number of groups with signal
staying within (v + η + 1)·B. f̂ is capped at buffer.max_filtered_share, so outstanding prompts never exceed
1 / (1 - max_filtered_share) times the unfiltered quota (10x at the default 0.9; above the cap the buffer warns).

Why η still holds: admission is the soft bound. Every lease is still refused "stale" for v < V - η, and before every
batch is drawn for step s the buffer drops each group with a sample older than s - η (`BufferState.drop_stale`,
called by `BufferCore._draw`, the only path to a draw). Leasing more prompts at version v makes no sample staler: when
fewer groups than f̂ predicts are filtered, the surplus waits in the buffer and is trained later or, once older than
η, dropped and counted as dropped_stale. What the cap bounds is that waste, not η.

Everything but `FilterWindow` is a pure function; the window's state is restored from the journal (its arrivals in
order, or a compacted journal's `counters` record).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from fractions import Fraction

import numpy as np

FILTERS = ("none", "no_signal")
FLOAT32_EPS = 2.0**-23  # float32's machine epsilon: the gap between 1.0 and the next float32
SPREAD_ULPS = 4  # c - 1 for sums of up to c = 5 non-negative float32 components (module docstring)


def spread_tolerance(rewards: np.ndarray) -> float:
    """SPREAD_ULPS float32 ulps (relative) of the group's largest |reward| (module docstring)."""
    return SPREAD_ULPS * FLOAT32_EPS * float(np.max(np.abs(rewards.astype(np.float64))))


def no_signal(rewards: np.ndarray, min_reward_spread: float) -> bool:
    """True when max(r) - min(r) <= min_reward_spread + spread_tolerance(r): the group teaches nothing.
    `rewards`: float [n], n >= 1 (finite: `buffers.checks.group_problem` ran first)."""
    values = rewards.astype(np.float64)
    return float(values.max() - values.min()) <= min_reward_spread + spread_tolerance(values)


def keep_fraction(filtered: int, arrivals: int, max_filtered_share: float) -> Fraction:
    """1 - f̂ as an exact fraction: f̂ = filtered / arrivals (0 without arrivals), capped at max_filtered_share.
    Exact, so that `signal_quota` floors without rounding error (a float 4 / (2/3) may land under 6)."""
    if not 0 < max_filtered_share < 1:
        raise ValueError(f"max_filtered_share: must be in (0, 1) (got {max_filtered_share})")
    share = Fraction(filtered, arrivals) if arrivals else Fraction(0)
    return 1 - min(share, Fraction(max_filtered_share))


def signal_quota(
    policy_version: int,
    max_staleness: int,
    groups_per_step: int,
    trained_and_buffered: int,
    outstanding: int,
    keep: Fraction,
) -> int:
    """Prompts a generator at `policy_version` may still start: ⌊((v + η + 1)·B - trained - buffered) / keep⌋ -
    outstanding (may be <= 0). keep = 1 gives `buffers.staleness.admission_quota` exactly."""
    if not 0 < keep <= 1:
        raise ValueError(f"keep: must be in (0, 1] (got {keep})")
    room = (policy_version + max_staleness + 1) * groups_per_step - trained_and_buffered
    return int(room // keep) - outstanding if room > 0 else room - outstanding


def mostly_filtered_warning(share: float, window: int, max_filtered_share: float) -> str:
    """What a filtered share over the cap means, and what to change (logged by the buffer once per window)."""
    return (
        f"dynamic sampling filtered {100 * share:.0f}% of the last {window} groups (buffer.max_filtered_share = "
        f"{100 * max_filtered_share:.0f}%): their rewards were all equal, so the task is too easy or too hard for the "
        "policy and the generators spend most of their time on groups that teach nothing. Change the task's "
        "difficulty (env.difficulty, the dataset), raise algo.group_size (more chances of a spread), or give partial "
        "credit in the reward; buffer.min_reward_spread above 0 filters more, not less"
    )


class FilterWindow:
    """The last `size` arrivals that passed their checks: filtered (True) or kept (False); `warn_due` says when
    the filtered share is over the cap, at most once per `size` arrivals."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"filter_window: must be >= 1 arrival (got {size})")
        self.size = size
        self.arrivals: deque[bool] = deque(maxlen=size)
        self.filtered = 0  # True values in `arrivals`
        self.since_warning = size  # arrivals since the last warning (a full window: the first may warn)

    def record(self, filtered: bool) -> None:
        if len(self.arrivals) == self.size:
            self.filtered -= self.arrivals[0]
        self.arrivals.append(filtered)
        self.filtered += filtered
        self.since_warning += 1

    @property
    def share(self) -> float:
        """Filtered share of the window (0.0 while empty)."""
        return self.filtered / len(self.arrivals) if self.arrivals else 0.0

    def keep(self, max_filtered_share: float) -> Fraction:
        return keep_fraction(self.filtered, len(self.arrivals), max_filtered_share)

    def warn_due(self, max_filtered_share: float) -> bool:
        """True (and the clock restarted) when the window is full, its share exceeds the cap, and the last
        warning was at least a window ago."""
        due = len(self.arrivals) == self.size and self.share > max_filtered_share and self.since_warning >= self.size
        if due:
            self.since_warning = 0
        return due

    def snapshot(self) -> list[bool]:
        return list(self.arrivals)

    def restore(self, arrivals: Iterable[bool]) -> None:
        self.arrivals.clear()
        self.filtered = 0
        for filtered in arrivals:
            self.record(bool(filtered))
        self.since_warning = self.size
