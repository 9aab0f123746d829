"""Wall time to a held-out accuracy: asynchronous GRPO against the better of two synchronous setups, per workload.

    .venv/bin/python -m benchmarks.time_to_accuracy                       # A, B, C x 3 setups x seeds 0 1 (hours)
    .venv/bin/python -m benchmarks.time_to_accuracy --workloads C --seeds 0 1 --steps 16
    .venv/bin/python -m benchmarks.time_to_accuracy --quick               # workload C, seed 0, 12 steps
    .venv/bin/python -m benchmarks.time_to_accuracy --from-runs runs/time_to_accuracy/<stamp>   # recompute, no run

Workloads (benchmarks/workloads/*.toml: SmolLM2-135M-Instruct learns held-out level-2 word problems with GRPO and
the math verifier; the files say why each is built so):
  A  single-turn, completions of at most 48 tokens: training-bound
  B  single-turn, up to 384 tokens: a step's completion lengths spread over an order of magnitude
  C  two-turn episodes whose tool (a checker) takes log-normal time, median 0.5 s, 1% of calls over 10 s
Setups, run one after another (they share this machine's cores, so never side by side):
  async           algo.max_staleness = 2, run.placement = split: the generator on one half of the cores, the
                  learner on the other, each working while the other does
  sync            algo.max_staleness = 0, split: today's placement; half the machine idles in each phase
  sync-colocated  algo.max_staleness = 0, run.placement = colocated: every core to each phase in turn (what
                  colocated trainers do)

The measure. Held-out strict accuracy at temperature 1 from the run's eval.jsonl (eval set word_problems-d2: 4
samples of each of the first 24-32 held-out questions at versions 0, 4, 8, ... and the last), with its standard
error over prompts (`strict_accuracy_stderr`). The time of version v is when the learner published it (its
metrics record appeared; `benchmarks.runs.RunWatcher`), in seconds since the run was launched: start-up counts
(it is the same for every setup), the evaluation's own latency does not (it differs between setups and is the
measurement, not the training). Version 0 is at time 0. The times are kept beside the run as published.json, so
`--from-runs` recomputes everything.
Target, the same for every run of a workload: `--target W=X`, or by default acc0 + GAIN x (median peak - acc0),
acc0 the mean accuracy at version 0 over the workload's runs and "median peak" the median of the runs' highest
accuracies: halfway (GAIN = 0.5) up the typical rise, far enough above version 0 that sampling noise at the start
does not reach it, low enough that a run which learns as the others do reaches it. A run that never does (one that
collapsed, say) has no time and orders as slower than any. (The lowest peak instead of the median, the first rule
tried, let one collapsed run pull the target down into version 0's noise: workload C's sync seed 1 fell from
0.109 to 0.023.) Time to accuracy: the time of the first evaluated version whose accuracy reaches the target.
Headline: `time_to_accuracy_ratio` {W: the median over seeds of async's time over the better synchronous setup's
(the one whose median time is lower), each seed's runs against each other}, `time_to_accuracy_spread` {W: the
largest minus the smallest of those per-seed ratios; null with one seed}, `ratio_seeds` {W: how many seeds had both
an async and a better-setup run (the issue asks for >= 2)}, `better_sync` {W: which setup that was}, `overlap_bound`
{W: (t_gen + t_train) / max(t_gen, t_train) of the split synchronous runs, the most that overlapping generation
with training can give; t_gen = the learner's mean wait for a batch, t_train = its mean train + publish time,
after step 1}, `targets`. A ratio whose seeds lack a time is null, with the reason in `ratio_why_null`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, cpu, save, side_by_side
from benchmarks.runs import PUBLISHED, REPO, kept_runs, launch_fresh_run, mean_of, trained_rate
from common.metrics import read_metrics

HERE = Path(__file__).resolve().parent
WORKLOADS = {
    "A": HERE / "workloads" / "a_single_turn.toml",
    "B": HERE / "workloads" / "b_long_tail.toml",
    "C": HERE / "workloads" / "c_slow_tools.toml",
}
SETUPS: dict[str, dict[str, Any]] = {
    "async": {"algo.max_staleness": 2, "run.placement": "split"},
    "sync": {"algo.max_staleness": 0, "run.placement": "split"},
    "sync-colocated": {"algo.max_staleness": 0, "run.placement": "colocated"},
}
ASYNC, SYNC_SETUPS = "async", ("sync", "sync-colocated")
GAIN = 0.5
FIRST_STEP = 1  # step splits and rates after this step's record (step 1's batch also waits for start-up)
RUN_NAME = re.compile(r"(?P<workload>[A-Z])-(?P<setup>[a-z-]+)-seed(?P<seed>\d+)")
DEFAULT_RUNS_DIR = REPO / "runs" / "time_to_accuracy"
QUICK = {"workloads": ["C"], "seeds": [0], "steps": 12}
TARGET_RATIO = 0.8  # the target on workloads B and C
RUN_KEY = ("workload", "setup", "seed")  # a run of the grid; a saved run with the same key is replaced


# ------------------------------------------------------------------------------------------- one run's figures
def eval_curve(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """(version, accuracy, stderr) of every eval row that has sampled strict accuracy (greedy rows are left out),
    oldest version first; a version evaluated twice keeps its first row."""
    curve: dict[int, dict[str, Any]] = {}
    for row in rows:
        for key, value in row.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "eval" and parts[2] == "strict_accuracy" and value is not None:
                stderr = row.get(f"eval/{parts[1]}/strict_accuracy_stderr")
                curve.setdefault(int(row["step"]), {"version": int(row["step"]), "accuracy": value, "stderr": stderr})
    return [curve[v] for v in sorted(curve)]


def run_figures(
    name: str, workload: str, setup: str, seed: int, run_dir: Path, published: dict[int, float]
) -> dict[str, Any]:
    """The figures of one finished run from its directory (metrics.jsonl, eval.jsonl, config.json) and the
    publication times of its versions (seconds since launch)."""
    records = read_metrics(run_dir / "metrics.jsonl")
    config = json.loads((run_dir / "config.json").read_text())
    per_step = config["learner"]["groups_per_step"] * config["algo"]["group_size"]
    times = {0: 0.0, **published}
    curve = [
        {**point, "time_s": times[point["version"]], "samples_trained": point["version"] * per_step}
        for point in eval_curve(read_metrics(run_dir / "eval.jsonl"))
        if point["version"] in times
    ]
    after = [r for r in records if r["step"] > FIRST_STEP]
    return {
        "name": name,
        "workload": workload,
        "setup": setup,
        "seed": seed,
        "steps": len(records),
        "curve": curve,
        "t_gen_s": mean_of(records, "perf/wait_s", FIRST_STEP),
        "t_train_s": mean_of(records, "perf/train_s", FIRST_STEP) + mean_of(records, "perf/publish_s", FIRST_STEP),
        "samples_per_s": trained_rate(records, FIRST_STEP)["samples_per_s"] if len(after) else None,
        "completion_tokens_min": mean_of(records, "perf/completion_tokens_min"),
        "completion_tokens_max": mean_of(records, "perf/completion_tokens_max"),
        "staleness_mean": mean_of(records, "staleness/mean"),
        "last_published_s": max(times.values()),
    }


def time_to(curve: list[dict[str, Any]], target: float) -> float | None:
    """The time of the first point whose accuracy reaches `target`; None if none does."""
    return next((point["time_s"] for point in curve if point["accuracy"] >= target), None)


# ------------------------------------------------------------------------------------------- a workload's figures
def auto_target(runs: list[dict[str, Any]]) -> float:
    """acc0 + GAIN x (median peak - acc0) over these runs (the module docstring says why)."""
    starts = [p["accuracy"] for run in runs for p in run["curve"] if p["version"] == 0]
    peaks = [max(p["accuracy"] for p in run["curve"]) for run in runs if run["curve"]]
    if not starts or not peaks:
        raise ValueError("no run has an evaluation at version 0 and later: the target cannot be set")
    acc0 = statistics.fmean(starts)
    return acc0 + GAIN * (statistics.median(peaks) - acc0)


def workload_figures(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """Per run its time to `target`; the better synchronous setup; per-seed ratios, their median and spread."""
    times = {(run["setup"], run["seed"]): time_to(run["curve"], target) for run in runs}
    median_time = {}
    for setup in SYNC_SETUPS:
        seen = [t for (s, _), t in times.items() if s == setup]
        median_time[setup] = statistics.median([math.inf if t is None else t for t in seen]) if seen else None
    present = [s for s in SYNC_SETUPS if median_time[s] is not None]
    better = min(present, key=lambda s: median_time[s]) if present else None
    ratios, why = {}, None
    for seed in sorted({seed for _, seed in times}):
        mine, theirs = times.get((ASYNC, seed)), times.get((better, seed))
        if (ASYNC, seed) not in times or (better, seed) not in times:
            continue
        if mine is None or theirs is None:
            why = f"seed {seed}: {'async' if mine is None else better} did not reach the target"
            continue
        if theirs == 0.0:  # already at version 0: the target is in the start's noise (a fixed --target too low)
            why = f"seed {seed}: {better} was at the target at version 0"
            continue
        ratios[seed] = mine / theirs
    return {
        "target": target,
        "time_to_target_s": {f"{setup}/seed{seed}": t for (setup, seed), t in sorted(times.items())},
        "median_time_s": {s: None if t is None or math.isinf(t) else t for s, t in median_time.items()},
        "better_sync": better,
        "ratios": ratios,
        "ratio": statistics.median(ratios.values()) if ratios else None,
        "spread": max(ratios.values()) - min(ratios.values()) if len(ratios) >= 2 else None,  # one seed: no spread
        "seeds": len(ratios),
        "ratio_why_null": None if ratios else (why or "no seed has both an async and a synchronous run"),
        "overlap_bound": _overlap_bound([r for r in runs if r["setup"] == "sync"]),
    }


def _overlap_bound(sync_runs: list[dict[str, Any]]) -> float | None:
    bounds = [
        (r["t_gen_s"] + r["t_train_s"]) / max(r["t_gen_s"], r["t_train_s"])
        for r in sync_runs
        if r["t_gen_s"] == r["t_gen_s"] and r["t_train_s"] == r["t_train_s"] and max(r["t_gen_s"], r["t_train_s"]) > 0
    ]
    return statistics.median(bounds) if bounds else None


def figures(runs: list[dict[str, Any]], fixed_targets: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Every workload's figures, its target fixed or set from its runs."""
    out = {}
    for workload in sorted({run["workload"] for run in runs}):
        mine = [run for run in runs if run["workload"] == workload]
        target = fixed_targets.get(workload, None)
        out[workload] = workload_figures(mine, auto_target(mine) if target is None else target)
    return out


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The headline keys (module docstring), from a saved result's per-workload figures."""
    per = result["workloads"]
    return {
        "time_to_accuracy_ratio": {w: f["ratio"] for w, f in per.items()},
        "time_to_accuracy_spread": {w: f["spread"] for w, f in per.items()},
        "ratio_seeds": {w: f.get("seeds") for w, f in per.items()},
        "better_sync": {w: f["better_sync"] for w, f in per.items()},
        "overlap_bound": {w: f["overlap_bound"] for w, f in per.items()},
        "targets": {w: f["target"] for w, f in per.items()},
        "ratio_why_null": {w: f["ratio_why_null"] for w, f in per.items() if f["ratio_why_null"]},
    }


# ------------------------------------------------------------------------------------------- running
def run_grid(workloads: list[str], setups: list[str], seeds: list[int], steps: int, root: Path) -> list[dict]:
    """Every run, seed by seed and workload by workload (an interrupted grid leaves whole comparisons)."""
    runs = []
    for seed in seeds:
        for workload in workloads:
            for setup in setups:
                name = f"{workload}-{setup}-seed{seed}"
                overrides = {**SETUPS[setup], "run.seed": seed, "learner.total_steps": steps}
                print(f"{name}: running ...", flush=True)
                outcome = launch_fresh_run(WORKLOADS[workload], root, name, overrides, 900 + 240 * steps)
                run = run_figures(name, workload, setup, seed, outcome.run_dir, outcome.published_s())
                run.update(wall_s=outcome.wall_s, load_avg=outcome.load_avg, cpu=cpu())
                runs.append(run)
                print(describe(run), flush=True)
    return runs


def load_runs(folder: Path) -> list[dict[str, Any]]:
    """The figures of every `<W>-<setup>-seed<N>/` run under `folder` that has published.json."""
    runs = []
    for published_path in sorted(folder.glob(f"*/{PUBLISHED}")):
        run_dir = published_path.parent
        named = RUN_NAME.fullmatch(run_dir.name)
        if named is None or named["workload"] not in WORKLOADS or named["setup"] not in SETUPS:
            print(f"left out {run_dir}: not named <workload>-<setup>-seed<N>")
            continue
        workload, setup, seed = named["workload"], named["setup"], named["seed"]
        published = {int(k): v for k, v in json.loads(published_path.read_text()).items()}
        runs.append(run_figures(run_dir.name, workload, setup, int(seed), run_dir, published))
    if not runs:
        raise SystemExit(f"no run under {folder}: expected <W>-<setup>-seed<N>/{PUBLISHED}")
    return runs


def describe(run: dict[str, Any]) -> str:
    points = " ".join(f"v{p['version']}@{p['time_s']:.0f}s={p['accuracy']:.3f}" for p in run["curve"])
    return (
        f"{run['name']}: {points}; t_gen {run['t_gen_s']:.1f} s, t_train {run['t_train_s']:.1f} s a step; "
        f"completion tokens min/max {run['completion_tokens_min']:.0f}/{run['completion_tokens_max']:.0f}"
    )


def plot(runs: list[dict[str, Any]], per_workload: dict[str, dict[str, Any]]):
    def draw(axes: Any) -> None:
        panels = side_by_side(axes, len(per_workload), width=6 * len(per_workload))
        colors = {setup: f"C{i}" for i, setup in enumerate(SETUPS)}
        seeds = sorted({run["seed"] for run in runs})
        for panel, (workload, figs) in zip(panels, per_workload.items(), strict=True):
            for run in (r for r in runs if r["workload"] == workload):
                curve = run["curve"]
                panel.errorbar(
                    [p["time_s"] for p in curve],
                    [p["accuracy"] for p in curve],
                    yerr=[p["stderr"] or 0.0 for p in curve],
                    color=colors[run["setup"]],
                    linestyle=("-", "--", ":", "-.")[seeds.index(run["seed"]) % 4],
                    marker="o",
                    markersize=3,
                    capsize=2,
                    label=f"{run['setup']} seed {run['seed']}",
                )
            panel.axhline(figs["target"], color="grey", linewidth=0.8)
            ratio = "null" if figs["ratio"] is None else f"{figs['ratio']:.2f}"
            panel.set_title(f"workload {workload}: async / {figs['better_sync']} = {ratio}")
            panel.set_xlabel("seconds since launch (version published)")
            panel.set_ylabel("held-out strict accuracy, temperature 1")
            panel.legend(fontsize=7)

    return draw


def _targets(values: list[str]) -> dict[str, float]:
    out = {}
    for value in values:
        workload, _, number = value.partition("=")
        if workload not in WORKLOADS or not number:
            raise SystemExit(f"--target {value!r}: write W=X with W one of {', '.join(WORKLOADS)}")
        out[workload] = float(number)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=None, help="default A B C")
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="run.seed values (default 0 1)")
    parser.add_argument("--steps", type=int, default=None, help="learner steps per run (default: the workload's)")
    parser.add_argument("--quick", action="store_true", help="workload C, seed 0, 12 steps")
    parser.add_argument("--target", nargs="*", default=[], help="W=X: a fixed target accuracy for workload W")
    parser.add_argument("--out", default="time_to_accuracy", help="results/<OUT>.json and .png")
    parser.add_argument("--from-runs", type=Path, default=None, help="compute from the runs in DIR; run nothing")
    parser.add_argument("--runs-dir", type=Path, default=None, help="default runs/time_to_accuracy/<now>")
    parser.add_argument(
        "--fresh", action="store_true", help="do not keep the saved result's runs that this invocation did not redo"
    )
    args = parser.parse_args(argv)
    started = time.time()
    if args.from_runs is not None:
        runs = load_runs(args.from_runs)
        for run in runs:
            print(describe(run))
    else:
        workloads = args.workloads or (QUICK["workloads"] if args.quick else list(WORKLOADS))
        seeds = args.seeds or (QUICK["seeds"] if args.quick else [0, 1])
        steps = args.steps or (QUICK["steps"] if args.quick else 24)
        root = args.runs_dir or DEFAULT_RUNS_DIR / time.strftime("%Y%m%d-%H%M%S")
        root.mkdir(parents=True, exist_ok=True)
        runs = run_grid(workloads, args.setups, seeds, steps, root)
    if not args.fresh:
        runs = kept_runs(RESULTS / f"{args.out}.json", runs, RUN_KEY) + runs
    per_workload = figures(runs, _targets(args.target))
    for workload, figs in per_workload.items():
        ratio = "null (" + str(figs["ratio_why_null"]) + ")" if figs["ratio"] is None else f"{figs['ratio']:.3f}"
        print(
            f"workload {workload}: target {figs['target']:.3f}; median time {figs['median_time_s']}; "
            f"async over {figs['better_sync']}: {ratio} (target <= {TARGET_RATIO} on B and C); overlap bound "
            f"{figs['overlap_bound']}"
        )
    result = {
        "source": f"--from-runs {args.from_runs}" if args.from_runs else "grid",
        "seconds": time.time() - started,
        "gain": GAIN,
        "workloads": per_workload,
        "runs": runs,
    }
    result["headline"] = headline(result)
    save(args.out, result, plot(runs, per_workload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
