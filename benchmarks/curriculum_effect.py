"""The curriculum in the buffer against the same run without it: wall time to a held-out accuracy, and the share of
generated groups that carried no signal.

    .venv/bin/python -m benchmarks.curriculum_effect                   # seeds 0 1, 16 steps, both setups (~1 h)
    .venv/bin/python -m benchmarks.curriculum_effect --quick           # seed 0, 12 steps
    .venv/bin/python -m benchmarks.curriculum_effect --from-runs runs/curriculum_effect/<stamp>   # recompute

The workload (benchmarks/workloads/curriculum_mixed.toml): GSM8K-shaped word problems, a third each of levels 1, 2
and 3 (train split, one worked example; written here to <runs>/mixed.jsonl), 48-token completions, GRPO with the
math verifier, η = 2 (the default async placement). Setups, one after another on this machine:
  none        buffer.curriculum = "none": epochs in a seeded permutation
  pass_rate   buffer.curriculum = "pass_rate" (buffers/curriculum.py), default band (0, 1) and revisit share 0.1
The measure is benchmarks/time_to_accuracy's. The held-out strict accuracy at temperature 1 comes from the run's
eval.jsonl (eval set word_problems-d2, 32 questions x 4 samples, every 4 versions). The time of a version is when
the learner published it, in seconds since launch. The target is the same for both setups: halfway from the mean
accuracy at version 0 up to the median of the runs' peaks. The no-signal share is
`buffer/no_signal_share_generated` from the buffer's last metrics record: the share of arrived groups whose rewards
were all equal.
Headline:
- `curriculum_time_ratio`: the median over seeds of pass_rate's time to the target over none's (target: <= 1, no
  slower), with `curriculum_ratio_seeds`; null when no seed has both times, the reason in `curriculum_ratio_why_null`
  (a run that never reaches the target counts as slower than any).
- `final_accuracy`: {setup/seed: the accuracy at the last evaluated version}.
- `no_signal_share_generated`: {setup: the mean over seeds} (target: lower with the curriculum).
- `pass_leased`: {setup: {bucket: share of the prompts leased}}.
- `target`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, cpu, save
from benchmarks.runs import PUBLISHED, REPO, kept_runs, launch_fresh_run
from benchmarks.time_to_accuracy import auto_target, describe, run_figures, time_to
from buffers.curriculum import BUCKETS
from common.metrics import read_metrics
from common.word_problems import word_problem_prompts

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "curriculum_mixed.toml"
SETUPS = ("none", "pass_rate")
LEVELS = (1, 2, 3)
PER_LEVEL = 512
SHOTS = 1
QUICK = {"seeds": [0], "steps": 12}
DEFAULT_RUNS_DIR = REPO / "runs" / "curriculum_effect"
RUN_KEY = ("setup", "seed")


def write_mixed(path: Path) -> Path:
    """PER_LEVEL train-split word problems of each level in LEVELS, as chat rows with their worked answer."""
    with path.open("w") as out:
        for level in LEVELS:
            for record in word_problem_prompts(PER_LEVEL, seed=0, difficulty=level, split="train", shots=SHOTS):
                row = {"messages": record.messages, "answer": record.metadata["answer"], "level": level}
                out.write(json.dumps(row) + "\n")
    return path


def buffer_figures(run_dir: Path) -> dict[str, Any]:
    """The no-signal share of generated groups and the leased pass-rate histogram (shares), from buffer.jsonl."""
    path = run_dir / "buffer.jsonl"
    records = read_metrics(path) if path.exists() else []
    last = records[-1] if records else {}
    leased = {bucket: float(last.get(f"buffer/pass_leased/{bucket}", 0)) for bucket in BUCKETS}
    total = sum(leased.values())
    return {
        "no_signal_share_generated": last.get("buffer/no_signal_share_generated"),
        "arrived_groups": last.get("buffer/arrived_groups"),
        "pass_leased": {b: (n / total if total else None) for b, n in leased.items()},
        "pass_generated": {b: last.get(f"buffer/pass_generated/{b}", 0) for b in BUCKETS[1:]},
    }


def one_run(setup: str, seed: int, run_dir: Path, published: dict[int, float]) -> dict[str, Any]:
    run = run_figures(f"{setup}-seed{seed}", "mixed", setup, seed, run_dir, published)
    return {**run, **buffer_figures(run_dir)}


def run_grid(seeds: list[int], steps: int, root: Path) -> list[dict[str, Any]]:
    source = write_mixed(root / "mixed.jsonl")
    runs = []
    for seed in seeds:
        for setup in SETUPS:
            name = f"{setup}-seed{seed}"
            overrides = {
                "buffer.curriculum": setup,
                "env.source": str(source),
                "run.seed": seed,
                "learner.total_steps": steps,
            }
            print(f"{name}: running ...", flush=True)
            outcome = launch_fresh_run(WORKLOAD, root, name, overrides, 900 + 240 * steps)
            run = one_run(setup, seed, outcome.run_dir, outcome.published_s())
            run.update(wall_s=outcome.wall_s, load_avg=outcome.load_avg, cpu=cpu())
            runs.append(run)
            print(f"{describe(run)}; no-signal share {run['no_signal_share_generated']}", flush=True)
    return runs


def load_runs(folder: Path) -> list[dict[str, Any]]:
    runs = []
    for published_path in sorted(folder.glob(f"*/{PUBLISHED}")):
        setup, _, seed = published_path.parent.name.rpartition("-seed")
        if setup in SETUPS and seed.isdigit():
            published = {int(k): v for k, v in json.loads(published_path.read_text()).items()}
            runs.append(one_run(setup, int(seed), published_path.parent, published))
    if not runs:
        raise SystemExit(f"no run under {folder}: expected <setup>-seed<N>/{PUBLISHED}")
    return runs


def figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The target, each run's time to it, the per-seed ratios and the per-setup buffer figures."""
    target = auto_target(runs)
    times = {(r["setup"], r["seed"]): time_to(r["curve"], target) for r in runs}
    ratios, why = {}, []
    for seed in sorted({r["seed"] for r in runs}):
        mine, theirs = times.get(("pass_rate", seed)), times.get(("none", seed))
        if mine is not None and theirs:  # both reached it, and none not already at version 0
            ratios[seed] = mine / theirs
        else:
            late = [s for s, t in (("pass_rate", mine), ("none", theirs)) if t is None]
            why.append(f"seed {seed}: " + (f"{', '.join(late)} never reached it" if late else "none at it at v0"))
    per_setup = {}
    for setup in SETUPS:
        mine = [r for r in runs if r["setup"] == setup]
        shares = [r["no_signal_share_generated"] for r in mine if r["no_signal_share_generated"] is not None]
        leased = [r["pass_leased"] for r in mine if r["pass_leased"]["none"] is not None]
        per_setup[setup] = {
            "no_signal_share_generated": statistics.fmean(shares) if shares else None,
            "pass_leased": {b: statistics.fmean(h[b] for h in leased) for b in BUCKETS} if leased else None,
        }
    return {
        "target": target,
        "time_to_target_s": {f"{s}/seed{seed}": t for (s, seed), t in sorted(times.items())},
        "ratios": ratios,
        "ratio": statistics.median(ratios.values()) if ratios else None,
        "ratio_why_null": None if ratios else "; ".join(why),
        "final_accuracy": {f"{r['setup']}/seed{r['seed']}": r["curve"][-1]["accuracy"] for r in runs if r["curve"]},
        "setups": per_setup,
    }


def headline(result: dict[str, Any]) -> dict[str, Any]:
    f = result["figures"]
    return {
        "curriculum_time_ratio": f["ratio"],
        "curriculum_ratio_seeds": len(f["ratios"]),
        "curriculum_ratio_why_null": f["ratio_why_null"],
        "final_accuracy": f["final_accuracy"],
        "no_signal_share_generated": {s: v["no_signal_share_generated"] for s, v in f["setups"].items()},
        "pass_leased": {s: v["pass_leased"] for s, v in f["setups"].items()},
        "target": f["target"],
    }


def plot(runs: list[dict[str, Any]], figs: dict[str, Any]):
    def draw(axes: Any) -> None:
        for run in runs:
            curve = run["curve"]
            axes.errorbar(
                [p["time_s"] for p in curve],
                [p["accuracy"] for p in curve],
                yerr=[p["stderr"] or 0.0 for p in curve],
                color="C0" if run["setup"] == "none" else "C1",
                linestyle=("-", "--", ":")[run["seed"] % 3],
                marker="o",
                markersize=3,
                capsize=2,
                label=f"{run['setup']} seed {run['seed']} (no signal {run['no_signal_share_generated']:.2f})",
            )
        axes.axhline(figs["target"], color="grey", linewidth=0.8)
        axes.set_xlabel("seconds since launch (version published)")
        axes.set_ylabel("held-out strict accuracy (word_problems-d2), temperature 1")
        axes.set_title(f"curriculum / none, time to target: {figs['ratio']}")
        axes.legend(fontsize=7)

    return draw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="run.seed values (default 0 1)")
    parser.add_argument("--steps", type=int, default=None, help="learner steps per run (default 16)")
    parser.add_argument("--quick", action="store_true", help="seed 0, 12 steps")
    parser.add_argument("--out", default="curriculum_effect", help="results/<OUT>.json and .png")
    parser.add_argument("--from-runs", type=Path, default=None, help="compute from the runs in DIR; run nothing")
    parser.add_argument("--runs-dir", type=Path, default=None, help="default runs/curriculum_effect/<now>")
    parser.add_argument("--fresh", action="store_true", help="drop the saved result's runs this one did not redo")
    args = parser.parse_args(argv)
    started = time.time()
    if args.from_runs is not None:
        runs = load_runs(args.from_runs)
    else:
        seeds = args.seeds or (QUICK["seeds"] if args.quick else [0, 1])
        steps = args.steps or (QUICK["steps"] if args.quick else 16)
        root = args.runs_dir or DEFAULT_RUNS_DIR / time.strftime("%Y%m%d-%H%M%S")
        root.mkdir(parents=True, exist_ok=True)
        runs = run_grid(seeds, steps, root)
    if not args.fresh:
        runs = kept_runs(RESULTS / f"{args.out}.json", runs, RUN_KEY) + runs
    figs = figures(runs)
    print(
        f"target {figs['target']:.3f}; time to it {figs['time_to_target_s']}; curriculum / none {figs['ratio']}; "
        f"no-signal share { ({s: v['no_signal_share_generated'] for s, v in figs['setups'].items()}) }"
    )
    result = {"source": str(args.from_runs or "grid"), "seconds": time.time() - started, "figures": figs, "runs": runs}
    result["headline"] = headline(result)
    save(args.out, result, plot(runs, figs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
