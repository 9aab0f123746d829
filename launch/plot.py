"""`tandem plot`: the eval curves of a run (docs/evaluation.md), against policy version and against wall time.

    tandem plot runs/demo                                      # -> runs/demo/eval.png
    tandem plot runs/demo --out demo.png --metrics strict_accuracy,lenient_accuracy,greedy/strict_accuracy

It reads `<run_dir>/eval.jsonl` (the buffer's eval rows: one per set and version, `eval/<set>/<metric>`) and
`<run_dir>/metrics.jsonl` (the learner's steps), and draws two panels: each set's metrics against the policy
version that produced them, with the training `reward/mean` on a second axis for reference (the reward of the
training batches, at the learner step that made that version), and against wall time (the rows' `time`: seconds
since the buffer started, the clock of buffer.jsonl). The learner's records count seconds since the learner
started, a clock a few seconds behind the buffer's that the files do not relate, so the reward is drawn on the
version panel only. A metric is a key after `eval/<set>/`: `strict_accuracy`,
`lenient_accuracy`, `pass@1`, `pass@k`, `mean_reward`, `reward/<component>`, `mean_tokens`, `truncated_share`, or
any of them after `greedy/`.

Refused with one line that says what to change (exit 2): a run directory that does not exist, one without
eval.jsonl (the run had no `eval.sets`) or without metrics.jsonl, eval rows none of which holds a metric asked for,
and a missing matplotlib (it comes with the `cpu` and `gpu` extras: `pip install 'tandem-rl[cpu]'`). A half-written
last line of either file (a run still going) is skipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from common.metrics import read_metrics
from launch.progress import EVAL_STREAM, EvalPoint, read_eval

USAGE_ERROR = 2
DEFAULT_METRICS = "strict_accuracy,lenient_accuracy"
DEFAULT_OUT = "eval.png"  # in the run directory
REFERENCE_KEY = "reward/mean"
METRIC_STYLES = ("-", ":", "-.", (0, (5, 1)), (0, (1, 3)))  # the reference curve is the only "--" one


class PlotUsageError(ValueError):
    """An argument `tandem plot` cannot use; the message says what to change."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem plot",
        description="Plot a run's eval curves (eval.jsonl) against policy version and wall time, with the training "
        "reward/mean (metrics.jsonl) for reference.",
    )
    parser.add_argument("run_dir", type=Path, help="the run directory (run.run_dir): holds eval.jsonl, metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None, help=f"the PNG to write (default RUN_DIR/{DEFAULT_OUT})")
    parser.add_argument(
        "--metrics",
        default=DEFAULT_METRICS,
        help=f"comma-separated metrics after eval/<set>/ (default {DEFAULT_METRICS}; e.g. pass@k, "
        "greedy/strict_accuracy, reward/correct, mean_tokens)",
    )
    return parser


def load_run(run_dir: Path, metrics: list[str]) -> tuple[dict[str, list[EvalPoint]], list[dict[str, Any]]]:
    """(set label -> its eval points, the learner's records) of `run_dir`; raises PlotUsageError for a missing run
    directory or file, an eval.jsonl without eval rows, and metrics that no eval row holds (naming those that do)."""
    if not run_dir.is_dir():
        raise PlotUsageError(f"{run_dir} is not a directory: give a run directory (run.run_dir of a tandem run)")
    eval_path, metrics_path = run_dir / EVAL_STREAM, run_dir / "metrics.jsonl"
    if not eval_path.exists():
        raise PlotUsageError(
            f"{eval_path} does not exist: the run did not evaluate during training (set eval.sets, e.g. "
            "--eval.sets '[\"arithmetic\"]', and run it again), or it stopped before its first eval result"
        )
    if not metrics_path.exists():
        raise PlotUsageError(f"{metrics_path} does not exist: {run_dir} is not the directory of a tandem run")
    series = read_eval(eval_path)
    if not series:
        raise PlotUsageError(f"{eval_path} holds no eval rows (eval/<set>/<metric>) yet")
    present = sorted({key for points in series.values() for point in points for key in point.metrics})
    missing = [metric for metric in metrics if metric not in present]
    if missing:
        raise PlotUsageError(f"--metrics {','.join(missing)}: no eval row holds it; the rows hold {', '.join(present)}")
    return series, read_metrics(metrics_path)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plot_run(run_dir: Path, out: Path, metrics: list[str]) -> Path:
    """Draw the two panels of `run_dir` into `out` (a PNG; its directory is created) and return `out`.
    Raises PlotUsageError as `load_run` does, and when matplotlib is not installed."""
    series, steps = load_run(run_dir, metrics)
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: a file only
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise PlotUsageError(
            f"tandem plot needs matplotlib ({error}): install the cpu or gpu extra, pip install 'tandem-rl[cpu]'"
        ) from error
    simulated = any(record.get("simulation") for record in steps)
    figure, (by_version, by_time) = plt.subplots(1, 2, figsize=(14, 5), constrained_layout=True)
    panels = ((by_version, "version", "policy version"), (by_time, "time", "seconds since the buffer started"))
    for axis, x_key, x_label in panels:
        for color, (label, points) in enumerate(series.items()):
            for style, metric in enumerate(metrics):
                xy = [(_x(p, x_key), p.metrics.get(metric)) for p in points]
                xy = [(x, y) for x, y in xy if _number(x) and _number(y)]
                if xy:
                    axis.plot(
                        *zip(*xy, strict=True),
                        color=f"C{color % 10}",  # one colour per set, one line style per metric
                        linestyle=METRIC_STYLES[style % len(METRIC_STYLES)],
                        marker="o",
                        markersize=3,
                        label=f"{label} {metric}",
                    )
        axis.set_xlabel(x_label)
        axis.set_ylabel("eval")
        axis.grid(alpha=0.3)
        reference = [(r.get("step"), r.get(REFERENCE_KEY)) for r in steps] if x_key == "version" else []
        reference = [(x, y) for x, y in reference if _number(x) and _number(y)]
        if reference:
            twin = axis.twinx()
            twin.plot(*zip(*reference, strict=True), color="gray", linestyle="--", linewidth=1, label=REFERENCE_KEY)
            twin.set_ylabel(f"training {REFERENCE_KEY} (dashed)")
        axis.legend(fontsize="small", loc="best")
    title = f"{run_dir.resolve().name}: eval during training"
    figure.suptitle(("SIMULATION " if simulated else "") + title)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def _x(point: EvalPoint, key: str) -> float | None:
    return point.version if key == "version" else point.time


def main(argv: list[str]) -> int:
    """`tandem plot ARGV`: 0 when the PNG was written; 2 (a usage error) with one line saying what to change."""
    args = _parser().parse_args(argv)
    metrics = list(dict.fromkeys(part.strip() for part in args.metrics.split(",") if part.strip()))
    out = args.out if args.out is not None else args.run_dir / DEFAULT_OUT
    try:
        if not metrics:
            raise PlotUsageError(f"--metrics {args.metrics!r} names no metric; e.g. --metrics {DEFAULT_METRICS}")
        written = plot_run(args.run_dir, out, metrics)
    except PlotUsageError as error:
        print(f"tandem plot: {error}", file=sys.stderr)
        return USAGE_ERROR
    print(written)
    return 0
