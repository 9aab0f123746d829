"""The console of `tandem run`: a live progress bar fed by `metrics.jsonl`, and the end-of-run summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Self

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from common.metrics import read_metrics


class RunProgress:
    """Follows the learner's metrics file and shows step, reward, staleness and the rates: trained samples/s and
    tokens/s over wall clock (`throughput/…`, waiting included) and the trainer's compute-only tokens/s."""

    def __init__(self, metrics_path: Path, total_steps: int) -> None:
        self.metrics_path = metrics_path
        self.offset = 0
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(bar_width=20),  # room for the status: rich cuts a line wider than the terminal
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self.task = self.progress.add_task("train", total=total_steps, status="waiting for the first step")

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.refresh()
        self.progress.stop()

    def refresh(self) -> None:
        latest = None
        if self.metrics_path.exists():
            with self.metrics_path.open() as handle:
                handle.seek(self.offset)
                for line in handle:
                    if not line.endswith("\n"):
                        break  # a line being written: read it next time
                    self.offset += len(line.encode())
                    try:
                        latest = json.loads(line)
                    except json.JSONDecodeError:
                        continue
        if latest is not None:
            self.progress.update(self.task, completed=latest["step"], status=_status(latest))


def _fmt(record: dict[str, Any], key: str, spec: str) -> str:
    value = record.get(key)
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _status(record: dict[str, Any]) -> str:
    """One line of a learner record; 'SIMULATION' first when the record comes from a simulated run."""
    return (
        ("SIMULATION " if record.get("simulation") else "")
        + f"reward {_fmt(record, 'reward/mean', '.3f')} staleness {_fmt(record, 'staleness/mean', '.2f')}"
        f" (max {_fmt(record, 'staleness/max', '.0f')}) {_fmt(record, 'throughput/samples_per_s', ',.1f')} samples/s"
        f" {_fmt(record, 'throughput/tokens_per_s', ',.0f')} tok/s"
        f" (train {_fmt(record, 'perf/train_tokens_per_s', ',.0f')} tok/s)"
    )


def reward_rise(records: list[dict[str, Any]], fraction: float = 0.2) -> tuple[float, float]:
    """(mean reward/mean over the first `fraction` of steps, same over the last `fraction`)."""
    rewards = [r["reward/mean"] for r in records if isinstance(r.get("reward/mean"), (int, float))]
    if not rewards:
        return float("nan"), float("nan")
    k = max(1, int(len(rewards) * fraction))
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def reward_sources(records: list[dict[str, Any]], run_dir: Path) -> list[str]:
    """The summary's lines on where the reward came from, when a run has named components: each component's
    (reward/<name>) first vs last 20% of steps, e.g. the verifier's `correct` beside `reward_model`, so that a
    reward model that is being gamed shows; and the groups whose reward model fell back (every generator's last
    `actor/reward_model_fallbacks`), when a reward model scored."""
    names = sorted({k for r in records for k in r if k.startswith("reward/")} - {"reward/mean", "reward/std"})
    lines = []
    for key in names:
        first, last = reward_rise([{"reward/mean": r[key]} for r in records if key in r])
        lines.append(f"  {key}  first 20% of steps {first:.3f}  ->  last 20% {last:.3f}")
    fallbacks = None
    for path in sorted(run_dir.glob("generator-*.jsonl")):
        generator = read_metrics(path)
        if generator and "actor/reward_model_fallbacks" in generator[-1]:
            fallbacks = (fallbacks or 0) + int(generator[-1]["actor/reward_model_fallbacks"])
    if fallbacks is not None:
        lines.append(f"  reward model fallbacks {fallbacks} groups (env.fallback_reward given)")
    return lines


def summarize(run_dir: Path, wall_s: float, first_step: int = 0) -> str:
    """The end-of-run summary: the steps and samples of this session (after `first_step`, the checkpoint a resume
    started from) and, after a resume, of the whole run; reward first vs last steps of the run (and of each reward
    component: `reward_sources`), samples dropped, wall time, where TensorBoard is."""
    metrics_path = run_dir / "metrics.jsonl"
    records = read_metrics(metrics_path) if metrics_path.exists() else []
    session = [r for r in records if int(r.get("step", 0)) > first_step]
    first, last = reward_rise(records)
    last_record = records[-1] if records else {}
    trained = sum(int(r.get("perf/samples", 0) or 0) for r in session)
    dropped = last_record.get("buffer/dropped_stale", 0)
    resumed = (
        f" (resumed at step {first_step}; the run: {len(records)} steps, "
        f"{sum(int(r.get('perf/samples', 0) or 0) for r in records)} samples trained)"
        if first_step
        else ""
    )
    lines = [
        "",
        f"run finished: {len(session)} learner steps in {wall_s / 60:.1f} min{resumed}",
        f"  reward/mean  first 20% of steps {first:.3f}  ->  last 20% {last:.3f}  (change {last - first:+.3f})",
        *reward_sources(records, run_dir),
        f"  samples trained {trained}{' this session' if first_step else ''}   dropped as stale {dropped}",
        f"  final policy_version {last_record.get('policy_version', '-')}",
        f"  metrics   {metrics_path}",
        f"  logs      {run_dir / 'logs'}",
        f"  tensorboard --logdir {run_dir / 'tb'}",
    ]
    return "\n".join(lines)
