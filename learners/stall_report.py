"""Why the learner waits: one line, from what the roles measure, when a batch is far later than the run can afford.

    watch = WaitWatch(BatchNeeds.from_config(config), first_after_s=config.learner.wait_report_s)
    batch, wait_s = link.fetch_batch(step, on_wait=lambda waited_s: say(watch.waiting(step, waited_s, link.stats)))
    watch.stepped(step_s)                                   # after each step: the threshold follows the step time

A wait for the batch of one step is reported once it exceeds max(first_after_s, 3 x the median step time so far),
then every max(repeat_s, that threshold) while it lasts; a new step starts the clock again. Each report asks the
buffer for its counters (`learners.buffer_link.BufferLink.stats`: the ledger, rejections by kind, `tokens_sampled`
from the generators' heartbeats, `tokens_arrived`, `generators_alive`) and compares them with the previous answer
(the first one is taken a few seconds into the wait), so the rate and the counts are those of the last window.

`why_waiting` (pure: counters in, the line out) says, in this order: how long, whether the buffer or any generator is
heard from, the generation rate (completion tokens per second, unfinished samples included), what one batch needs
(groups_per_step x group_size samples and their tokens) and how long that takes at this rate, what went wrong in the
window (groups refused by kind, leases expired, generators lost or stuck, samples dropped as stale or without signal),
and what to change. `tandem run` prints the line above its progress bar (`launch.progress`, from `waiting.jsonl`).
Imports nothing heavy.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

WAITING_STREAM = "waiting"  # <run_dir>/waiting.jsonl: one record per report (`message` is the line)
REPEAT_S = 300.0  # at least this long between two reports of one wait
Counters = Mapping[str, int]


@dataclass(frozen=True)
class BatchNeeds:
    """What one batch needs and what a user can change, from the run's config."""

    groups_per_step: int  # learner.groups_per_step
    group_size: int  # algo.group_size
    max_tokens: int  # generator.max_tokens
    generators: int  # generator.count (those `tandem run` starts; a fleet may have others)
    dtype: str  # model.dtype as configured ("auto", "bfloat16", "float32")
    max_staleness: int  # algo.max_staleness
    buffer_address: str  # learner.buffer_address

    @classmethod
    def from_config(cls, config: Any) -> BatchNeeds:
        """From a `common.config.TandemConfig`."""
        return cls(
            groups_per_step=config.learner.groups_per_step,
            group_size=config.algo.group_size,
            max_tokens=config.generator.max_tokens,
            generators=config.generator.count,
            dtype=config.model.dtype,
            max_staleness=config.algo.max_staleness,
            buffer_address=config.learner.buffer_address,
        )


@dataclass(frozen=True)
class WaitReport:
    line: str
    values: dict[str, float]  # learner/waiting_for_batch_s, and generation/tokens_per_s when known


def duration(seconds: float) -> str:
    """'45s', '6m10s', '2h03m'."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def generation_rate(before: Counters | None, after: Counters | None, window_s: float) -> float | None:
    """Completion tokens per second the generators sampled between two answers (None without both, or under 1 s)."""
    if before is None or after is None or window_s < 1.0:
        return None
    return max(0, after.get("tokens_sampled", 0) - before.get("tokens_sampled", 0)) / window_s


def _delta(before: Counters | None, after: Counters, key: str) -> int:
    return max(0, after.get(key, 0) - (before or {}).get(key, 0))


def _troubles(before: Counters | None, after: Counters, needs: BatchNeeds) -> tuple[list[str], list[str]]:
    """(what went wrong in the window, what to change for it)."""
    said, fixes = [], []
    refused = {
        k: _delta(before, after, k) for k in after if k.startswith("rejected_") and not k.startswith("rejected_eval")
    }
    refused = {k: v for k, v in sorted(refused.items(), key=lambda kv: -kv[1]) if v}
    if refused:
        kinds = ", ".join(f"{k} {v}" for k, v in list(refused.items())[:3])
        said.append(f"groups refused: {kinds}")
        fixes.append("the buffer's log says why each group was refused")
    expired = _delta(before, after, "leases_expired")
    if expired:
        why = [
            f"{k} {_delta(before, after, k)}"
            for k in ("generators_lost", "generators_stuck")
            if _delta(before, after, k)
        ]
        said.append(f"leases_expired {expired}" + (f" ({', '.join(why)})" if why else ""))
        fixes.append(
            "a lost generator died or hung (its log says why); a stuck one made no progress for buffer.stall_timeout_s"
        )
    stale = _delta(before, after, "dropped_stale")
    if stale:
        said.append(f"dropped_stale {stale} samples (older than algo.max_staleness = {needs.max_staleness} versions)")
        fixes.append("a larger algo.max_staleness, or fewer generator.prompts_in_flight")
    no_signal = _delta(before, after, "dropped_no_signal")
    if no_signal:
        said.append(f"dropped_no_signal {no_signal} samples (groups whose rewards are all equal)")
        fixes.append('buffer.filter = "none", or an easier task')
    return said, fixes


def _speedups(needs: BatchNeeds) -> str:
    """What makes generation of one batch faster, named by config key."""
    ways = []
    if needs.dtype == "bfloat16":
        ways.append("model.dtype = float32 (or auto: bf16 is emulated, ~4.5x slower, on a CPU without avx512_bf16/amx)")
    ways.append(f"a lower generator.max_tokens ({needs.max_tokens})")
    ways.append(f"a lower learner.groups_per_step ({needs.groups_per_step})")
    ways.append(f"more generators (generator.count = {needs.generators})")
    return ", ".join(ways)


def why_waiting(
    step: int, waited_s: float, needs: BatchNeeds, before: Counters | None, after: Counters | None, window_s: float
) -> str:
    """The line that says why the batch of `step` has not come after `waited_s` seconds. `before`/`after`: the
    buffer's counters (`BufferLink.stats`) at the start and the end of a window of `window_s` seconds (`after` None:
    the buffer did not answer; `before` None: no earlier answer, counts are then since the buffer started)."""
    head = f"no batch for step {step} after {duration(waited_s)}"
    if after is None:
        return (
            f"{head}: the buffer at {needs.buffer_address} does not answer (is it running? its log says; "
            "learner.buffer_address must be its address)"
        )
    alive, sampled = after.get("generators_alive", 0), after.get("tokens_sampled", 0)
    if alive == 0:
        if sampled == 0 and after.get("arrived_groups", 0) == 0:
            return (
                f"{head}: no generator has been heard from by the buffer at {needs.buffer_address} (no heartbeat, no "
                f"group): are the generators running (generator.count = {needs.generators}; their logs say) and "
                "is generator.buffer_address this buffer's?"
            )
        lost = after.get("generators_lost", 0)
        return (
            f"{head}: no generator is alive (none heard from within buffer.heartbeat_timeout_s; generators_lost "
            f"{lost}, tokens sampled before {sampled:,}): their logs say why they stopped"
        )
    samples = needs.groups_per_step * needs.group_size
    arrived, tokens_arrived = after.get("arrived", 0), after.get("tokens_arrived", 0)
    if arrived and tokens_arrived:
        per_sample = tokens_arrived / arrived
        need = f"{samples} samples ({needs.groups_per_step} groups x {needs.group_size}), ~{samples * per_sample:,.0f} tokens"
    else:
        per_sample = float(needs.max_tokens)
        need = (
            f"{samples} samples ({needs.groups_per_step} groups x {needs.group_size}), up to "
            f"{samples * needs.max_tokens:,} tokens (generator.max_tokens = {needs.max_tokens})"
        )
    buffered = after.get("buffered_groups", 0)
    parts = [f"{head} ({buffered}/{needs.groups_per_step} groups buffered)"]
    rate = generation_rate(before, after, window_s)
    generators = f"{alive} generator{'s' if alive != 1 else ''} alive"
    if rate is None:
        parts.append(f"{generators}, {sampled:,} tokens sampled so far")
    elif rate == 0:
        parts.append(
            f"{generators} but no token sampled in the last {duration(window_s)} (loading weights, a slow "
            "environment call or the engine's warm-up?)"
        )
    else:
        batch_s = samples * per_sample / rate
        parts.append(f"generation {rate:,.1f} tok/s ({generators})")
        bound = "" if arrived and tokens_arrived else "up to "
        parts.append(f"one batch needs {need}: {bound}~{duration(batch_s)} at this rate")
    said, fixes = _troubles(before, after, needs)
    parts.extend(said)
    slow = rate is not None and rate > 0 and samples * per_sample / rate > 60.0
    if slow or not said:
        fixes.append(f"to generate a batch faster: {_speedups(needs)}")
    line = "; ".join(parts)
    return f"{line}. Change: {'; '.join(fixes)}" if fixes else line


class WaitWatch:
    """Decides when a wait is reported and keeps the counters of the previous answer (see the module docstring).
    One loop calls it; `stats` is called on that loop's thread."""

    def __init__(
        self,
        needs: BatchNeeds,
        first_after_s: float = 120.0,
        repeat_s: float = REPEAT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.needs, self.first_after_s, self.repeat_s, self.clock = needs, first_after_s, repeat_s, clock
        self.step_times: list[float] = []
        self.step: int | None = None
        self.next_at = 0.0
        self.baseline: tuple[float, Counters | None] | None = None  # (clock, counters) of the last answer

    def stepped(self, step_s: float) -> None:
        """A step was trained in `step_s` seconds, its wait included."""
        self.step_times.append(step_s)

    def threshold_s(self) -> float:
        """How long a wait may last before it is reported: max(first_after_s, 3 x the median step time so far)."""
        return (
            max(self.first_after_s, 3 * statistics.median(self.step_times)) if self.step_times else self.first_after_s
        )

    def waiting(self, step: int, waited_s: float, stats: Callable[[], Counters | None]) -> WaitReport | None:
        """The report due now for the wait for `step`'s batch, or None; the first call of a wait asks `stats` for
        the baseline of the window."""
        if step != self.step:
            self.step, self.next_at = step, self.threshold_s()
            self.baseline = (self.clock(), stats())
            return None
        if waited_s < self.next_at:
            return None
        now, after = self.clock(), stats()
        since, before = self.baseline if self.baseline is not None else (now, None)
        line = why_waiting(step, waited_s, self.needs, before, after, now - since)
        values = {"learner/waiting_for_batch_s": waited_s}
        rate = generation_rate(before, after, now - since)
        if rate is not None:
            values["generation/tokens_per_s"] = rate
        if after is not None:
            self.baseline = (now, after)
        self.next_at = waited_s + max(self.repeat_s, self.threshold_s())
        return WaitReport(line, values)
