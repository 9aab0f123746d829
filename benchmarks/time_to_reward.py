"""Wall time to a target reward, and throughput against the overlap bound, of the demo at η ∈ {0, 2} ± filtering.

The demo with and without dynamic sampling (`buffer.filter = "no_signal"`), over seeds, one run after another.

    .venv/bin/python -m benchmarks.time_to_reward                        # the grid: 4 cells x 2 seeds x 30 steps (hours)
    .venv/bin/python -m benchmarks.time_to_reward --quick                # eta0, eta2, eta2-ds; seed 0; 20 steps
    .venv/bin/python -m benchmarks.time_to_reward --grid eta0 eta2-ds --seeds 0 1 2 --steps 20
    .venv/bin/python -m benchmarks.time_to_reward --from-runs benchmarks/results/kept_runs   # recompute, no run

The grid's cells: `eta0` (synchronous), `eta2` (the demo), `eta0-ds` and `eta2-ds` (the same with
`--buffer.filter no_signal`). Each run is `tandem run examples/demo.toml --algo.max_staleness η --run.seed S
--learner.total_steps N` (`benchmarks.runs.launch_run`), kept under `--runs-dir` so that `--from-runs` can
recompute the figures later (default runs/time_to_reward/<start time>/). The runs share this machine's cores, so they never run side by side.

The figures (time to target, samples/s, t_gen and t_train, the overlap bound, the headline) and how each is
measured: `benchmarks.time_to_reward_figures`. Writes results/<--out>.{json,png} (default time_to_reward): reward
against wall time for every run.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save, side_by_side
from benchmarks.runs import DEMO_CONFIG, REPO, launch_run
from benchmarks.time_to_reward_figures import (
    FIRST_STEP,
    REWARD_KEY,
    TARGET_FRACTION_OF_BOUND,
    TARGET_TIME_RATIO,
    TRAILING,
    RunKey,
    headline,
    pairs,
    run_figures,
)
from common.config import load_config
from common.metrics import read_metrics

TARGET_REWARD = 0.9
SYNC_ETA, ASYNC_ETA = 0, 2
CELLS = {  # name: (η, dynamic sampling)
    "eta0": (SYNC_ETA, False),
    "eta2": (ASYNC_ETA, False),
    "eta0-ds": (SYNC_ETA, True),
    "eta2-ds": (ASYNC_ETA, True),
}
DEFAULT_RUNS_DIR = REPO / "runs" / "time_to_reward"  # each grid in a folder of its own, named by its start
QUICK_CELLS, QUICK_STEPS = ("eta0", "eta2", "eta2-ds"), 20  # the headline's cells; the kept runs reached 0.9 by 20


NAME_ETA = re.compile(r"eta(\d+)")
NAME_SEED = re.compile(r"seed(\d+)")
NAME_DYNAMIC = re.compile(r"(?:^|[-_.])(?:ds|no_signal)(?:$|[-_.])")


def key_of(metrics: Path) -> RunKey | None:
    """A run's cell: from the run's config.json beside its metrics.jsonl, else from the file's name (`eta<N>`,
    optionally `seed<N>` (else the demo config's seed) and `ds` or `no_signal` for the filter); None when
    neither says η (a file of another kind of run)."""
    config = metrics.parent / "config.json"
    if metrics.name == "metrics.jsonl" and config.is_file():
        resolved = json.loads(config.read_text())
        dynamic = resolved["buffer"].get("filter") == "no_signal"
        return RunKey(int(resolved["algo"]["max_staleness"]), dynamic, int(resolved["run"]["seed"]))
    name = metrics.parent.name if metrics.name == "metrics.jsonl" else metrics.name.removesuffix(".metrics.jsonl")
    eta = NAME_ETA.search(name)
    if eta is None:
        return None
    seed = NAME_SEED.search(name)
    return RunKey(
        int(eta.group(1)),
        NAME_DYNAMIC.search(name) is not None,
        int(seed.group(1)) if seed else load_config(DEMO_CONFIG).run.seed,
    )


def load_runs(folder: Path, target: float) -> list[dict[str, Any]]:
    """The figures of every run under `folder`: run dirs (`<name>/metrics.jsonl`) and `<name>.metrics.jsonl`
    files; a file whose cell cannot be told is left out (and named). Two runs of one cell and seed are refused."""
    if not folder.is_dir():
        raise SystemExit(f"--from-runs {folder}: not a folder (pass the folder that holds the run dirs)")
    runs, seen = [], {}
    for metrics in sorted([*folder.glob("*/metrics.jsonl"), *folder.glob("*.metrics.jsonl")]):
        key = key_of(metrics)
        if key is None:
            print(f"left out {metrics}: its name says no eta<N> and it has no config.json beside it")
            continue
        if key in seen:
            raise SystemExit(f"{metrics} and {seen[key]} are both {key.cell} seed {key.seed}: keep one")
        seen[key] = metrics
        runs.append(run_figures(key, str(metrics.relative_to(folder)), read_metrics(metrics), target))
    if not runs:
        raise SystemExit(f"no run under {folder}: expected <run>/metrics.jsonl or <name-eta<N>>.metrics.jsonl")
    return runs


def run_grid(cells: list[str], seeds: list[int], steps: int, root: Path, sim_step_s: float | None, target: float):
    """Every (seed, cell) run, one after another (seed by seed, so that an interrupted grid leaves whole pairs);
    their figures. `sim_step_s`: the async_vs_sync SIMULATION config at that cost instead of the demo (tests)."""
    from benchmarks.async_vs_sync import SIM_CONFIG, sim_overrides

    config, extra, timeout_s = DEMO_CONFIG, {}, 900 + 150 * steps
    if sim_step_s is not None:
        config = root / "sim.toml"
        config.write_text(SIM_CONFIG)
        extra, timeout_s = sim_overrides(sim_step_s, weights_mb=1.0), 120 + 6 * steps * sim_step_s
    runs = []
    for seed in seeds:
        for cell in cells:
            eta, dynamic = CELLS[cell]
            name = f"{cell}-seed{seed}"
            if (root / name).exists():
                raise SystemExit(f"{root / name} exists (a run there would resume it): remove it or pass --runs-dir")
            overrides = {**extra, "algo.max_staleness": eta, "run.seed": seed, "learner.total_steps": steps}
            if dynamic:
                overrides["buffer.filter"] = "no_signal"
            print(f"{name}: running ...", flush=True)
            outcome = launch_run(config, root, name, overrides, timeout_s)
            run = run_figures(RunKey(eta, dynamic, seed), name, outcome.records, target)
            run.update(wall_s=outcome.wall_s, load_avg=outcome.load_avg, overrides=overrides)
            runs.append(run)
            print(describe(run), flush=True)
    return runs


def describe(run: dict[str, Any]) -> str:
    reached = run["time_to_target"]
    when = f"step {reached['step']} after {reached['time_s']:.0f} s" if reached["reached"] else "not reached"
    return (
        f"{run['label']} ({run['cell']}, seed {run['seed']}): target {when}; {run['samples_per_s']:.3f} samples/s; "
        f"t_gen {run['t_gen_s']:.2f} s, t_train {run['t_train_s']:.2f} s a step"
    )


def plot(runs: list[dict[str, Any]], target: float):
    """Panels: reward against wall time, and its trailing mean with the target, for every run."""

    def draw(axes: Any) -> None:
        raw, trailing = side_by_side(axes, 2, width=13)
        colors = {cell: f"C{i}" for i, cell in enumerate(CELLS)}
        seeds = sorted({run["seed"] for run in runs})
        for run in runs:
            curve = run["time_to_target"]["curve"]
            style = {"color": colors[run["cell"]], "linestyle": ("-", "--", ":", "-.")[seeds.index(run["seed"]) % 4]}
            label = f"{run['cell']} seed {run['seed']}: {run['samples_per_s']:.2f} samples/s"
            raw.plot(
                [p["time"] for p in curve], [p["reward"] for p in curve], marker="o", markersize=2, label=label, **style
            )
            shown = [p for p in curve if p["trailing"] is not None]
            trailing.plot([p["time"] for p in shown], [p["trailing"] for p in shown], label=label, **style)
            if run["time_to_target"]["reached"]:
                trailing.plot(
                    [run["time_to_target"]["time_s"]],
                    [run["time_to_target"]["trailing_mean_at_target"]],
                    marker="*",
                    markersize=10,
                    color=style["color"],
                )
        trailing.axhline(target, color="grey", linewidth=0.8)
        raw.set_title(f"reward vs wall time ({REWARD_KEY}; filtered runs: of every arrived group)")
        trailing.set_title(f"{TRAILING}-step trailing mean; target {target} (star: reached)")
        for ax in (raw, trailing):
            ax.set_xlabel("seconds on the learner's clock")
            ax.set_ylabel("reward")
            ax.legend(fontsize=7)

    return draw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", nargs="+", choices=list(CELLS), default=None, help="cells to run (default all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="run.seed values (default 0 1)")
    parser.add_argument("--steps", type=int, default=None, help="learner steps per run (default: the demo's)")
    parser.add_argument(
        "--quick", action="store_true", help=f"cells {' '.join(QUICK_CELLS)}, seed 0, {QUICK_STEPS} steps"
    )
    parser.add_argument("--target", type=float, default=TARGET_REWARD, help="target trailing-mean reward")
    parser.add_argument("--out", default="time_to_reward", help="results/<OUT>.json and .png")
    parser.add_argument("--from-runs", type=Path, default=None, help="compute from the runs in DIR; run nothing")
    parser.add_argument(
        "--runs-dir", type=Path, default=None, help="where the runs go (default runs/time_to_reward/<now>)"
    )
    parser.add_argument("--sim-step-s", type=float, default=None, help="SIMULATION config at this cost (tests)")
    args = parser.parse_args(argv)
    cells = args.grid or (list(QUICK_CELLS) if args.quick else list(CELLS))
    seeds = args.seeds or ([0] if args.quick else [0, 1])
    steps = args.steps or (QUICK_STEPS if args.quick else load_config(DEMO_CONFIG).learner.total_steps)
    if steps < max(TRAILING, FIRST_STEP + 1):
        parser.error(f"--steps must be >= {max(TRAILING, FIRST_STEP + 1)} (the trailing mean and the rates)")
    if args.from_runs is not None:
        runs = load_runs(args.from_runs, args.target)
        for run in runs:
            print(describe(run))
    else:
        root = args.runs_dir or DEFAULT_RUNS_DIR / time.strftime("%Y%m%d-%H%M%S")
        root.mkdir(parents=True, exist_ok=True)
        runs = run_grid(cells, seeds, steps, root, args.sim_step_s, args.target)
    top = headline(runs, args.target)
    print(
        f"async throughput: {_figure(top['async_fraction_of_bound'], top['async_fraction_of_bound_why_null'])} of "
        f"the overlap bound (target >= {TARGET_FRACTION_OF_BOUND}); time to reward, eta2-ds over eta0: "
        f"{_figure(top['time_to_reward_ratio'], top['time_to_reward_ratio_why_null'])} (target <= {TARGET_TIME_RATIO})"
    )
    result = {
        "headline": top,
        "source": f"--from-runs {args.from_runs}" if args.from_runs else "grid",
        "trailing": TRAILING,
        "first_step": FIRST_STEP,
        "simulation": args.sim_step_s is not None,
        "pairs": pairs(runs),
        "runs": runs,
    }
    save(args.out, result, plot(runs, args.target))
    return 0


def _figure(value: float | None, why: str | None) -> str:
    return f"{value:.3f}" if value is not None else f"null ({why})"


if __name__ == "__main__":
    raise SystemExit(main())
