"""Rank 0's view of training: one metrics record per step (metrics.jsonl + TensorBoard) and a progress bar.

    reporter = StepReporter(run_dir, total_steps, first_step, log)   # just before the first step of the session
    reporter.report(step, {"reward/mean": 0.4, ...})      # writes the record, advances the bar, logs one line
    reporter.close()

The record of a step holds what `train_step` returned plus what the loop measured (`perf/wait_s`,
`perf/publish_s`, `perf/step_s`, `perf/train_tokens_per_s`, `buffer/dropped_stale`, `policy_version`), the
end-to-end rates over wall clock that the reporter adds (`WallClockRates`: `perf/interval_s`, `throughput/…`),
and `step` and `time` (`MetricsSink`). The bar (rich) shows step, reward, staleness and the rates (an offline
stage, `learners.offline.loop`, passes its own `info`: its loss and rates); it only animates on a terminal, and the
same numbers go to the log every step either way.

Two kinds of rate, and why both: `perf/train_tokens_per_s` is the trainer's compute speed (tokens over the
`train_step` call alone), which does not move when generators are added; `throughput/samples_per_s` and
`throughput/tokens_per_s` count wall time, waiting for batches included, so they rise when generators are added to a
learner that waits for batches, and they never exceed the compute rate (see `WallClockRates`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from common.metrics import MetricsSink
from common.trackers import Trackers


@dataclass
class WallClockRates:
    """End-to-end training rates over wall clock, for one learner session (the process's run, resumed or not).

    `tick(now, samples, tokens)` at each step's record returns
        perf/interval_s                   wall seconds since the previous tick (the first: since `start`, the
                                          moment the session's loop began); wait, train, publish, checkpoint
                                          and reporting all fall inside it
        throughput/samples_per_s          samples / perf/interval_s (the step's trained samples, `perf/samples`)
        throughput/tokens_per_s           tokens / perf/interval_s (the same tokens as `perf/tokens`, prompt +
                                          completion, so that its ratio to perf/train_tokens_per_s is the share
                                          of wall time spent training: <= 1)
        throughput/session_samples_per_s  samples trained since `start` / seconds since `start`
        throughput/session_tokens_per_s   the same for tokens
    Steps trained by an earlier session (before a resume) count in neither. `now` comes from one monotonic clock
    (time.perf_counter); a tick at the same instant as the previous one gives an interval of 1e-9 s, not a
    division by zero."""

    start: float
    last: float | None = None
    samples: int = 0
    tokens: int = 0

    def tick(self, now: float, samples: int, tokens: int) -> dict[str, float]:
        interval_s = max(now - (self.start if self.last is None else self.last), 1e-9)
        session_s = max(now - self.start, 1e-9)
        self.last = now
        self.samples += samples
        self.tokens += tokens
        return {
            "perf/interval_s": interval_s,
            "throughput/samples_per_s": samples / interval_s,
            "throughput/tokens_per_s": tokens / interval_s,
            "throughput/session_samples_per_s": self.samples / session_s,
            "throughput/session_tokens_per_s": self.tokens / session_s,
        }


def rl_info(values: dict[str, Any]) -> str:
    """'v3 reward 0.400 staleness 0.50 12.5 samples/s ...': the RL learner's bar and log line."""
    return (
        f"v{values['policy_version']} reward {values['reward/mean']:.3f} "
        f"staleness {values['staleness/mean']:.2f} {rates_line(values)}"
    )


def rates_line(values: dict[str, Any]) -> str:
    """'12.5 samples/s 1,234 tok/s (train 43,210 tok/s)': end-to-end over wall clock, then compute only."""
    return (
        f"{values['throughput/samples_per_s']:,.1f} samples/s {values['throughput/tokens_per_s']:,.0f} tok/s "
        f"(train {values['perf/train_tokens_per_s']:,.0f} tok/s)"
    )


class StepReporter:
    """Metrics sink + progress bar for the learner's rank 0 (not thread-safe). Create it just before the session's
    first step: its creation starts the wall clock of the `throughput/…` rates."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        first_step: int,
        log: logging.Logger,
        clock: Callable[[], float] = time.perf_counter,
        simulation: bool = False,
        label: str = "learner",
        info: Callable[[dict[str, Any]], str] | None = None,
        trackers: Trackers | None = None,
    ) -> None:
        """`label` names the bar (the role: learner, sft, rm, dpo); `info(record)` is the text after the step on
        the bar and in the log line (default `rl_info`: version, reward, staleness, rates)."""
        self.sink = MetricsSink(run_dir, stream="metrics", simulation=simulation, trackers=trackers)
        self.log = log
        self.total_steps = total_steps
        self.clock = clock
        self.info = info or rl_info
        self.rates = WallClockRates(start=clock())
        console = Console(stderr=True)
        self.progress = Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            disable=not console.is_terminal,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=first_step, info="")
        self.progress.start()

    def report(self, step: int, values: dict[str, Any]) -> dict[str, Any]:
        """Write the record of `step` (the optimizer steps taken after it), with the wall-clock rates added, and
        show it; returns the record. `values` holds at least perf/samples, perf/tokens, perf/train_tokens_per_s
        and perf/step_s, and what `info` reads (the RL learner's: policy_version, reward/mean, staleness/mean,
        perf/wait_s); KeyError otherwise."""
        values = {**values, **self.rates.tick(self.clock(), int(values["perf/samples"]), int(values["perf/tokens"]))}
        record = self.sink.log(step, values)
        info = self.info(values)
        self.progress.update(self.task, completed=step, info=info)
        wait = f" wait {values['perf/wait_s']:.2f}s" if "perf/wait_s" in values else ""
        self.log.info("step %d/%d %s%s step %.2fs", step, self.total_steps, info, wait, values["perf/step_s"])
        return record

    def note(self, step: int, values: dict[str, Any], what: str) -> dict[str, Any]:
        """Write a record of `step` that no training step made (an offline stage's evaluation before its first
        step), as given (no rates, the bar unmoved), and log `what`; returns the record."""
        record = self.sink.log(step, values)
        self.log.info("step %d/%d %s", step, self.total_steps, what)
        return record

    def close(self) -> None:
        self.progress.stop()
        self.sink.close()
