"""Compare complete runs from their `metrics.jsonl`: did each learn (the demo criterion), how fast, how stale.

    .venv/bin/python -m benchmarks.demo_runs                       # the two demo runs kept in results/kept_runs/
    .venv/bin/python -m benchmarks.demo_runs --run async=runs/demo/metrics.jsonl --run sync=runs/sync/metrics.jsonl

The kept runs are `tandem demo` (η = 2) and the synchronous baseline, the same config with `--algo.max_staleness 0`,
each the full 30 steps on this 2-core machine, and a LoRA run of the demo with one worked example (env.shots = 1):
`tandem demo --learner.lora.rank 16 --learner.lr 3e-4 --learner.total_steps 20 --eval.sets '[]'` (merged sync:
the generator's vLLM takes full weights as without LoRA). Per run: mean reward/mean over the first and the last 20% of steps
(the demo's criterion: the last at least RISE_TARGET above the first), trained samples/s from step 1 on, wall time
on the learner's clock, staleness and samples dropped as stale. Reading other runs needs no engine: it is
how to compare any two runs. Writes results/demo_runs.{json,png}.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, save, side_by_side
from benchmarks.runs import mean_of, trained_rate
from common.metrics import read_metrics
from launch.progress import reward_rise

RISE_TARGET = 0.15
KEPT = {
    "η = 2 (tandem demo)": RESULTS / "kept_runs" / "demo-eta2-async.metrics.jsonl",
    "η = 0 (synchronous baseline)": RESULTS / "kept_runs" / "demo-eta0-sync.metrics.jsonl",
    "LoRA r16, merged sync": RESULTS / "kept_runs" / "demo-lora.metrics.jsonl",
}


def summarize_run(label: str, path: Path) -> dict[str, Any]:
    records = read_metrics(path)
    if not records:
        raise SystemExit(f"{path} holds no learner step: pass a metrics.jsonl of a run that trained")
    first, last = records[0], records[-1]
    early, late = reward_rise(records)
    return {
        "label": label,
        "path": str(path),
        "steps": len(records),
        "wall_s": last["time"],
        "reward_first_20pct": early,
        "reward_last_20pct": late,
        "rise": late - early,
        "learned": late - early >= RISE_TARGET,
        "samples_per_s": trained_rate(records, int(first["step"]))["samples_per_s"] if len(records) > 1 else None,
        "staleness_mean": mean_of(records, "staleness/mean"),
        "staleness_max": max(r.get("staleness/max", 0) for r in records),
        "dropped_stale": last.get("buffer/dropped_stale", 0),
        "reward": [r.get("reward/mean") for r in records],
        "time": [r["time"] for r in records],
    }


def plot(runs: list[dict[str, Any]]):
    def draw(axes: Any) -> None:
        by_step, by_time = side_by_side(axes, 2, width=11)
        for run in runs:
            by_step.plot(range(1, run["steps"] + 1), run["reward"], marker="o", markersize=3, label=run["label"])
            by_time.plot(
                [t / 60 for t in run["time"]],
                run["reward"],
                marker="o",
                markersize=3,
                label=f"{run['label']}: {run['wall_s'] / 60:.1f} min",
            )
        by_step.set_xlabel("learner step")
        by_time.set_xlabel("minutes since the learner started")
        for ax in (by_step, by_time):
            ax.set_ylabel("reward/mean")
            ax.legend(fontsize=8)
        by_step.set_title("reward vs step")
        by_time.set_title("reward vs wall time")

    return draw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="a run's metrics.jsonl (repeatable); default: the two demo runs in results/kept_runs/",
    )
    args = parser.parse_args(argv)
    named = dict(item.split("=", 1) for item in args.run if "=" in item)
    if len(named) != len(args.run):
        parser.error("--run takes LABEL=PATH, e.g. --run sync=runs/sync/metrics.jsonl")
    runs = [summarize_run(label, Path(path)) for label, path in (named or KEPT).items()]
    for run in runs:
        rate = "-" if run["samples_per_s"] is None else f"{run['samples_per_s']:.2f}"
        print(
            f"{run['label']}: {run['steps']} steps in {run['wall_s'] / 60:.1f} min; reward first 20% "
            f"{run['reward_first_20pct']:.3f} -> last 20% {run['reward_last_20pct']:.3f} ({run['rise']:+.3f}, "
            f"{'learned' if run['learned'] else 'DID NOT LEARN'}: target +{RISE_TARGET}); {rate} samples/s; "
            f"staleness mean {run['staleness_mean']:.2f} max {run['staleness_max']:.0f}; "
            f"dropped as stale {run['dropped_stale']}"
        )
    headline = {
        "rise_target": RISE_TARGET,
        "all_learned": all(run["learned"] for run in runs),
        "rise": {run["label"]: run["rise"] for run in runs},
    }
    save("demo_runs", {"headline": headline, "runs": runs}, plot(runs))
    return 0 if headline["all_learned"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
