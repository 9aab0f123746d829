"""Rank 0's view of training: one metrics record per step (metrics.jsonl + TensorBoard) and a progress bar.

    reporter = StepReporter(run_dir, total_steps, first_step, log)
    reporter.report(step, {"reward/mean": 0.4, ...})      # writes the record, advances the bar, logs one line
    reporter.close()

The record of a step holds what `train_step` returned plus what the loop measured (`perf/wait_s`,
`perf/publish_s`, `perf/step_s`, `perf/tokens_per_s`, `buffer/dropped_stale`, `policy_version`);
`MetricsSink` adds `step` and `time`. The bar (rich) shows step, reward, staleness and tokens/s; it only
animates on a terminal, and the same numbers go to the log every step either way.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from common.metrics import MetricsSink


class StepReporter:
    """Metrics sink + progress bar for the learner's rank 0 (not thread-safe)."""

    def __init__(self, run_dir: Path, total_steps: int, first_step: int, log: logging.Logger) -> None:
        self.sink = MetricsSink(run_dir, stream="metrics")
        self.log = log
        self.total_steps = total_steps
        console = Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]learner"),
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
        """Write the record of `step` (the optimizer steps taken after it) and show it; returns the record.
        `values` holds at least policy_version, reward/mean, staleness/mean, perf/tokens_per_s, perf/wait_s and
        perf/step_s (KeyError otherwise)."""
        record = self.sink.log(step, values)
        info = (
            f"v{values['policy_version']} reward {values['reward/mean']:.3f} "
            f"staleness {values['staleness/mean']:.2f} {values['perf/tokens_per_s']:,.0f} tok/s"
        )
        self.progress.update(self.task, completed=step, info=info)
        self.log.info(
            "step %d/%d %s wait %.2fs step %.2fs",
            step,
            self.total_steps,
            info,
            values["perf/wait_s"],
            values["perf/step_s"],
        )
        return record

    def close(self) -> None:
        self.progress.stop()
        self.sink.close()
