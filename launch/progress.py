"""The console of `tandem run`: a live progress bar fed by `metrics.jsonl`, an eval line fed by `eval.jsonl` (when
the run evaluates, [eval]), the learner's explanations of a long wait for a batch printed above the bar as they
come (`waiting.jsonl`, `learners.stall_report`), and the end-of-run summary.

    with RunProgress(run_dir / "metrics.jsonl", total_steps) as progress:   # eval.jsonl is read from beside it
        while running:
            progress.refresh()                     # reads only what was appended since the last refresh
    print(summarize(run_dir, wall_s))

Both files are followed incrementally and tolerate a half-written last line (read on the next refresh) and a line
that is not JSON (skipped). Without eval.jsonl the display and the summary are what they were before evaluation
existed: no eval line, no eval section.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from common.metrics import read_metrics
from learners.stall_report import WAITING_STREAM

EVAL_STREAM = "eval.jsonl"  # the buffer's eval rows, beside metrics.jsonl (common.metrics.MetricsSink stream "eval")


class JsonlFollower:
    """Reads the records appended to a JSON-lines file since the last call; a missing file reads as no records, a
    last line without its newline (being written) is left for the next call, a line that is not JSON is skipped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new_records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        records = []
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            for line in handle:
                if not line.endswith(b"\n"):
                    break  # a line being written: read it next time
                self.offset += len(line)
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    continue
                if isinstance(record, dict):
                    records.append(record)
        return records


class _RunDisplay(Progress):
    """The progress bar, with the eval line under it once there is one."""

    eval_line = ""

    def get_renderables(self) -> Any:
        yield self.make_tasks_table(self.tasks)
        if self.eval_line:
            yield Text(self.eval_line, overflow="fold")


class RunProgress:
    """Follows the learner's metrics file and shows step, reward, staleness and the rates: trained samples/s and
    tokens/s over wall clock (`throughput/…`, waiting included) and the trainer's compute-only tokens/s. When the
    run evaluates, a second line shows each eval set's newest figures (`eval_line`), from `eval.jsonl` beside
    the metrics file."""

    def __init__(self, metrics_path: Path, total_steps: int) -> None:
        self.metrics_path = metrics_path
        self.metrics = JsonlFollower(metrics_path)
        self.evals = JsonlFollower(metrics_path.with_name(EVAL_STREAM))
        self.waits = JsonlFollower(metrics_path.with_name(f"{WAITING_STREAM}.jsonl"))
        self.newest_eval: dict[str, EvalPoint] = {}  # set label -> its newest version's figures
        self.progress = _RunDisplay(
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
        records = self.metrics.new_records()
        if records:
            latest = records[-1]
            self.progress.update(self.task, completed=latest.get("step", 0), status=_status(latest))
        for point in eval_points(self.evals.new_records()):
            newest = self.newest_eval.get(point.label)
            if newest is None or point.version >= newest.version:
                self.newest_eval[point.label] = point
        if self.newest_eval:
            self.progress.eval_line = eval_line(list(self.newest_eval.values()))
        for record in self.waits.new_records():  # a few minutes apart at most: printed, not kept on the display
            if isinstance(record.get("message"), str):
                self.progress.console.print(Text(f"learner: {record['message']}", style="yellow", overflow="fold"))


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


EVAL_PREFIX = "eval/"
GREEDY = "greedy/"


@dataclass(frozen=True)
class EvalPoint:
    """One eval set's figures at one policy version: `metrics` are the keys after `eval/<label>/` (`strict_accuracy`,
    `pass@k`, `greedy/strict_accuracy`, `reward/correct`, ...); `time` is the row's: seconds since the buffer
    started (the clock of buffer.jsonl)."""

    label: str
    version: int
    time: float | None
    metrics: dict[str, Any]


def eval_points(records: list[dict[str, Any]]) -> list[EvalPoint]:
    """The eval points of eval.jsonl records, in record order: one per set label found in a record's
    `eval/<label>/<metric>` keys (a record holds one set; several would give several points). A record without a
    numeric `step` is skipped."""
    points = []
    for record in records:
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        by_label: dict[str, dict[str, Any]] = {}
        for key, value in record.items():
            if key.startswith(EVAL_PREFIX) and key.count("/") >= 2:
                label, metric = key[len(EVAL_PREFIX) :].split("/", 1)
                by_label.setdefault(label, {})[metric] = value
        clock = record.get("time")
        for label, metrics in by_label.items():
            points.append(EvalPoint(label, step, clock if isinstance(clock, (int, float)) else None, metrics))
    return points


def read_eval(path: Path) -> dict[str, list[EvalPoint]]:
    """Set label -> its points in eval.jsonl, ordered by version (a torn last line is skipped)."""
    series: dict[str, list[EvalPoint]] = {}
    for point in eval_points(read_metrics(path)):
        series.setdefault(point.label, []).append(point)
    return {label: sorted(points, key=lambda p: p.version) for label, points in series.items()}


def _pass_at_k_name(metrics: dict[str, Any]) -> str:
    k = metrics.get("k")
    return f"pass@{k}" if isinstance(k, int) and not isinstance(k, bool) else "pass@k"


def _eval_figures(point: EvalPoint) -> str:
    """A set's figures on the eval line: those of the samples at temperature, else (greedy only) the greedy ones."""
    m = point.metrics
    if "strict_accuracy" in m or "pass@k" in m:
        return (
            f"strict {_fmt(m, 'strict_accuracy', '.2f')} lenient {_fmt(m, 'lenient_accuracy', '.2f')}"
            f" {_pass_at_k_name(m)} {_fmt(m, 'pass@k', '.2f')}"
        )
    return (
        f"greedy strict {_fmt(m, GREEDY + 'strict_accuracy', '.2f')}"
        f" lenient {_fmt(m, GREEDY + 'lenient_accuracy', '.2f')}"
    )


def eval_line(newest: list[EvalPoint]) -> str:
    """The eval line of the display: each set's newest figures, sets in the order given. One version up front
    when every set is at it (`eval v20  arithmetic strict ... | arithmetic-d2 ...`), else each set's own."""
    versions = {point.version for point in newest}
    if len(versions) == 1:
        sets = " | ".join(f"{point.label} {_eval_figures(point)}" for point in newest)
        return f"eval v{versions.pop()}  {sets}"
    return "eval  " + " | ".join(f"{point.label} v{point.version} {_eval_figures(point)}" for point in newest)


EVAL_COLUMNS = (  # (header, key after eval/<label>/) of the summary's eval table
    ("strict", "strict_accuracy"),
    ("lenient", "lenient_accuracy"),
    ("pass@1", "pass@1"),
    ("pass@k", "pass@k"),
    ("greedy strict", GREEDY + "strict_accuracy"),
    ("greedy lenient", GREEDY + "lenient_accuracy"),
)


def eval_summary(path: Path) -> list[str]:
    """The summary's eval lines: per set, its figures at the first and at the last version evaluated (one row when
    only one was). Empty when eval.jsonl does not exist or holds no eval rows."""
    series = read_eval(path) if path.exists() else {}
    if not series:
        return []
    width = max(len(label) for label in series)
    some_k = next((p.metrics for points in series.values() for p in points if "k" in p.metrics), {})
    headers = [_pass_at_k_name(some_k) if key == "pass@k" else header for header, key in EVAL_COLUMNS]
    lines = ["  eval (first vs last version evaluated)", "    " + " " * width + "  version  " + "  ".join(headers)]
    for label, points in series.items():
        for point in points[:1] + points[1:][-1:]:  # the first, and the last when there are two or more
            cells = "  ".join(
                format(_fmt(point.metrics, key, ".3f"), f">{len(header)}")
                for header, (_, key) in zip(headers, EVAL_COLUMNS, strict=True)
            )
            lines.append(f"    {label:<{width}}  {'v' + str(point.version):>7}  {cells}")
    lines.append(f"  eval rows {path}")
    return lines


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
        lines.append(f"  reward model fallbacks {fallbacks} groups (env.failure_reward given)")
    return lines


def summarize(run_dir: Path, wall_s: float, first_step: int = 0) -> str:
    """The end-of-run summary: the steps and samples of this session (after `first_step`, the checkpoint a resume
    started from) and, after a resume, of the whole run; reward first vs last steps of the run (and of each reward
    component: `reward_sources`), samples dropped, wall time, each eval set first vs last (`eval_summary`, when the
    run evaluated), where TensorBoard is."""
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
        *eval_summary(run_dir / EVAL_STREAM),
        f"  metrics   {metrics_path}",
        f"  logs      {run_dir / 'logs'}",
        f"  tensorboard --logdir {run_dir / 'tb'}",
    ]
    return "\n".join(lines)
