"""How the staleness bound η and the off-policy correction affect learning, in held-out accuracy per trained sample:
η in {0, 1, 2, 4, 8} x correction {none, tis, decoupled, a mask}, over seeds, on workload A of time_to_accuracy.

    .venv/bin/python -m benchmarks.staleness_effect                     # 5 η x 4 corrections x 3 seeds (a day here)
    .venv/bin/python -m benchmarks.staleness_effect --quick             # η in {0, 4}, tis and tis-icepop, seed 0
    .venv/bin/python -m benchmarks.staleness_effect --quick --seeds 1   # another seed beside the saved runs
    .venv/bin/python -m benchmarks.staleness_effect --etas 0 4 --corrections tis tis-icepop --seeds 0 1 2
    .venv/bin/python -m benchmarks.staleness_effect --from-runs runs/staleness_effect/<stamp>   # recompute

Every run is `tandem run benchmarks/workloads/a_single_turn.toml` (SmolLM2-135M-Instruct, held-out level-2 word
problems, GRPO, the math verifier, one vLLM generator on one core and one DeepSpeed learner on the other) with
`--algo.max_staleness η`, the correction's keys, `--run.seed S` and `--learner.total_steps N`. Every run trains the
same number of samples (N steps of 2 groups of 8), so accuracy at the end IS accuracy per trained sample.
The corrections (CORRECTIONS): `none` (plain PPO against the behaviour log-probs), `tis` (truncated importance
sampling, the default), `decoupled` (decoupled PPO), and masks on top of tis (learners.losses.importance_mask):
`tis-icepop` (tokens whose pi_prox/pi_behaviour lies outside [0.5, 2] are rejected), `tis-geometric` (whole
sequences whose geometric-mean ratio does). The default grid takes tis-icepop as the mask.

The measure: held-out strict accuracy at temperature 1 (eval.jsonl, set word_problems-d2, 4 samples of 32
questions) at the last two evaluated versions, averaged: `end_accuracy` of a run. Per cell (η, correction): the mean
over seeds and its standard error, sqrt(max(seed variance, mean evaluation variance) / seeds) when there are >= 2
seeds (the seed variance holds both the training's and the evaluation's noise; the evaluation's is its floor, since
the variance of two or three seeds has one or two degrees of freedom and falls below it by chance: two η = 4 runs
ending 0.301 and 0.332 give a seed standard error of 0.016 against evaluation errors of ~0.06 each, while two
same-config η = 0 runs ended 0.066 and 0.285), else the run's own evaluation error over prompts. A run's evaluation
error is the larger of its two end evaluations' (they ask the same prompts, so their mean does not halve the
variance).
Headline: `best_correction`, the correction with the highest mean end accuracy over the η > 0 cells (the runs
where a correction has anything to correct); `eta4_gap_stderr`, (acc(η = 4, best) - acc(η = 0, best)) /
sqrt(se4^2 + se0^2): the issue's target is >= -1 (η = 4 within one standard error of η = 0); `end_accuracy`
{cell: mean} and `end_stderr` {cell: se}; `samples_per_s` {cell: mean trained samples/s}. Null where a cell is
missing, with the reason in `why_null`. Writes results/<--out>.{json,png} (default staleness_effect).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, cpu, save, side_by_side
from benchmarks.runs import REPO, kept_runs, launch_fresh_run, mean_of, trained_rate
from benchmarks.time_to_accuracy import WORKLOADS, eval_curve
from common.metrics import read_metrics

CONFIG = WORKLOADS["A"]
CORRECTIONS: dict[str, dict[str, Any]] = {
    "none": {"algo.correction": "none", "algo.is_mask": "none"},
    "tis": {"algo.correction": "tis", "algo.is_mask": "none"},
    "decoupled": {"algo.correction": "decoupled", "algo.is_mask": "none"},
    "tis-icepop": {
        "algo.correction": "tis",
        "algo.is_mask": "token",
        "algo.is_mask_low": 0.5,
        "algo.is_mask_high": 2.0,
    },
    "tis-geometric": {
        "algo.correction": "tis",
        "algo.is_mask": "geometric",
        "algo.is_mask_low": 0.5,
        "algo.is_mask_high": 2.0,
    },
}
DEFAULT = {"etas": [0, 1, 2, 4, 8], "corrections": ["none", "tis", "decoupled", "tis-icepop"], "seeds": [0, 1, 2]}
QUICK = {"etas": [0, 4], "corrections": ["tis", "tis-icepop"], "seeds": [0], "steps": 16}
STEPS = 24
END_POINTS = 2  # evaluations averaged into a run's end accuracy
DEFAULT_RUNS_DIR = REPO / "runs" / "staleness_effect"
RUN_NAME = re.compile(r"eta(?P<eta>\d+)-(?P<correction>[a-z-]+)-seed(?P<seed>\d+)")
RUN_KEY = ("eta", "correction", "seed")  # a run of the grid; a saved run with the same key is replaced


def cell(eta: int, correction: str) -> str:
    return f"eta{eta}_{correction}"


def run_figures(name: str, eta: int, correction: str, seed: int, run_dir: Path) -> dict[str, Any]:
    """One finished run's figures from its metrics.jsonl and eval.jsonl."""
    records = read_metrics(run_dir / "metrics.jsonl")
    curve = eval_curve(read_metrics(run_dir / "eval.jsonl"))
    end = curve[-END_POINTS:]
    stderrs = [p["stderr"] for p in end if p["stderr"] is not None]
    return {
        "name": name,
        "eta": eta,
        "correction": correction,
        "seed": seed,
        "steps": len(records),
        "curve": curve,
        "end_versions": [p["version"] for p in end],
        "end_accuracy": statistics.fmean(p["accuracy"] for p in end) if end else None,
        "end_eval_stderr": max(stderrs) if stderrs else None,
        "samples_per_s": trained_rate(records, 1)["samples_per_s"] if len(records) > 1 else None,
        "reward": [r.get("reward/mean") for r in records],
        "staleness_mean": mean_of(records, "staleness/mean"),
        "masked_frac": mean_of(records, "policy/is_masked_frac"),
        "truncated_frac": mean_of(records, "policy/iw_truncated_frac"),
        "dropped_stale": records[-1].get("buffer/dropped_stale", 0) if records else 0,
    }


def cells(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per (η, correction): end accuracy's mean over seeds, its standard error (module docstring), samples/s."""
    out = {}
    for eta, correction in sorted({(r["eta"], r["correction"]) for r in runs}):
        mine = [r for r in runs if r["eta"] == eta and r["correction"] == correction and r["end_accuracy"] is not None]
        if not mine:
            continue
        values = [r["end_accuracy"] for r in mine]
        evals = [r["end_eval_stderr"] ** 2 for r in mine if r["end_eval_stderr"] is not None]
        floor = statistics.fmean(evals) if evals else 0.0  # a run's end accuracy varies at least by its evaluation
        if len(values) >= 2:
            se = math.sqrt(max(statistics.variance(values), floor) / len(values))
        else:
            se = mine[0]["end_eval_stderr"]
        rates = [r["samples_per_s"] for r in mine if r["samples_per_s"] is not None]
        out[cell(eta, correction)] = {
            "eta": eta,
            "correction": correction,
            "seeds": len(values),
            "end_accuracy": statistics.fmean(values),
            "stderr": se,
            "samples_per_s": statistics.fmean(rates) if rates else None,
        }
    return out


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The headline keys (module docstring) from a saved result's cells."""
    by_cell = result["cells"]
    stale = [c for c in by_cell.values() if c["eta"] > 0]
    corrections = sorted({c["correction"] for c in stale})
    best = (
        max(corrections, key=lambda k: statistics.fmean(c["end_accuracy"] for c in stale if c["correction"] == k))
        if corrections
        else None
    )
    gap, why = None, None
    four, zero = by_cell.get(cell(4, best)) if best else None, by_cell.get(cell(0, best)) if best else None
    if four is None or zero is None:
        why = f"needs the cells eta4_{best} and eta0_{best}" if best else "no run with η > 0"
    elif four["stderr"] is None or zero["stderr"] is None or four["stderr"] ** 2 + zero["stderr"] ** 2 == 0:
        why = "no standard error for eta4 or eta0 (no eval stderr and one seed)"
    else:
        gap = (four["end_accuracy"] - zero["end_accuracy"]) / math.sqrt(four["stderr"] ** 2 + zero["stderr"] ** 2)
    return {
        "best_correction": best,
        "eta4_gap_stderr": gap,
        "end_accuracy": {name: c["end_accuracy"] for name, c in by_cell.items()},
        "end_stderr": {name: c["stderr"] for name, c in by_cell.items()},
        "samples_per_s": {name: c["samples_per_s"] for name, c in by_cell.items()},
        "why_null": why,
    }


def run_grid(etas: list[int], corrections: list[str], seeds: list[int], steps: int, root: Path) -> list[dict]:
    """Seed by seed (an interrupted grid leaves whole seeds), every correction and η; one run at a time."""
    runs = []
    for seed in seeds:
        for correction in corrections:
            for eta in etas:
                name = f"eta{eta}-{correction}-seed{seed}"
                overrides = {
                    **CORRECTIONS[correction],
                    "algo.max_staleness": eta,
                    "run.seed": seed,
                    "learner.total_steps": steps,
                }
                outcome = launch_fresh_run(CONFIG, root, name, overrides, 900 + 240 * steps)
                run = run_figures(name, eta, correction, seed, outcome.run_dir)
                run.update(wall_s=outcome.wall_s, load_avg=outcome.load_avg, cpu=cpu())
                runs.append(run)
                print(describe(run), flush=True)
    return runs


def load_runs(folder: Path) -> list[dict[str, Any]]:
    runs = []
    for metrics in sorted(folder.glob("*/metrics.jsonl")):
        named = RUN_NAME.fullmatch(metrics.parent.name)
        if named is None or named["correction"] not in CORRECTIONS:
            print(f"left out {metrics.parent}: not named eta<N>-<correction>-seed<N>")
            continue
        eta, correction, seed = int(named["eta"]), named["correction"], int(named["seed"])
        runs.append(run_figures(metrics.parent.name, eta, correction, seed, metrics.parent))
    if not runs:
        raise SystemExit(f"no run under {folder}: expected eta<N>-<correction>-seed<N>/metrics.jsonl")
    return runs


def describe(run: dict[str, Any]) -> str:
    points = " ".join(f"v{p['version']}={p['accuracy']:.3f}" for p in run["curve"])
    end = "-" if run["end_accuracy"] is None else f"{run['end_accuracy']:.3f}"
    rate = "-" if run["samples_per_s"] is None else f"{run['samples_per_s']:.2f}"
    return (
        f"{run['name']}: held-out accuracy {points}; end {end}; {rate} samples/s; staleness mean "
        f"{run['staleness_mean']:.2f}; masked {run['masked_frac']:.4f}, truncated {run['truncated_frac']:.4f}"
    )


def plot(runs: list[dict[str, Any]], by_cell: dict[str, dict[str, Any]]):
    def draw(axes: Any) -> None:
        curves, ends = side_by_side(axes, 2, width=13)
        etas = sorted({r["eta"] for r in runs})
        corrections = sorted({r["correction"] for r in runs})
        colors = {eta: f"C{i}" for i, eta in enumerate(etas)}
        styles = {c: ("-", "--", ":", "-.", (0, (1, 4)))[i % 5] for i, c in enumerate(corrections)}
        for run in runs:
            curves.plot(
                [p["version"] for p in run["curve"]],
                [p["accuracy"] for p in run["curve"]],
                linestyle=styles[run["correction"]],
                color=colors[run["eta"]],
                marker="o",
                markersize=2,
                label=f"η={run['eta']} {run['correction']} s{run['seed']}",
            )
        for i, correction in enumerate(corrections):
            mine = [c for c in by_cell.values() if c["correction"] == correction]
            ends.errorbar(
                [c["eta"] + 0.08 * i for c in mine],
                [c["end_accuracy"] for c in mine],
                yerr=[c["stderr"] or 0.0 for c in mine],
                marker="o",
                capsize=3,
                linestyle=styles[correction],
                label=correction,
            )
        curves.set_xlabel("policy version (x 16 trained samples)")
        curves.set_ylabel("held-out strict accuracy, temperature 1")
        curves.legend(fontsize=6)
        ends.set_xlabel("η (max staleness)")
        ends.set_ylabel("end accuracy (mean over seeds ± stderr)")
        ends.legend(fontsize=7)
        curves.set_title("held-out accuracy per trained sample")
        ends.set_title("end accuracy by η and correction")

    return draw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="η in 0 4, tis and tis-icepop, seed 0, 16 steps")
    parser.add_argument("--etas", type=int, nargs="+", default=None, help="default 0 1 2 4 8")
    parser.add_argument("--corrections", nargs="+", choices=list(CORRECTIONS), default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2")
    parser.add_argument("--steps", type=int, default=None, help=f"learner steps per run (default {STEPS})")
    parser.add_argument("--out", default="staleness_effect", help="results/<OUT>.json and .png")
    parser.add_argument("--from-runs", type=Path, default=None, help="compute from the runs in DIR; run nothing")
    parser.add_argument("--runs-dir", type=Path, default=None, help="default runs/staleness_effect/<now>")
    parser.add_argument(
        "--fresh", action="store_true", help="do not keep the saved result's runs that this invocation did not redo"
    )
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DEFAULT
    started = time.time()
    if args.from_runs is not None:
        runs = load_runs(args.from_runs)
        for run in runs:
            print(describe(run))
    else:
        steps = args.steps or (QUICK["steps"] if args.quick else STEPS)
        root = args.runs_dir or DEFAULT_RUNS_DIR / time.strftime("%Y%m%d-%H%M%S")
        root.mkdir(parents=True, exist_ok=True)
        etas, corrections = args.etas or base["etas"], args.corrections or base["corrections"]
        runs = run_grid(etas, corrections, args.seeds or base["seeds"], steps, root)
    if not args.fresh:  # accuracy per trained sample: only runs of as many steps compare
        runs = kept_runs(RESULTS / f"{args.out}.json", runs, RUN_KEY, same=("steps",)) + runs
    result: dict[str, Any] = {
        "source": f"--from-runs {args.from_runs}" if args.from_runs else "grid",
        "config": str(CONFIG.relative_to(REPO)),
        "seconds": time.time() - started,
        "cells": cells(runs),
        "runs": runs,
    }
    result["headline"] = top = headline(result)
    gap = "null (" + str(top["why_null"]) + ")" if top["eta4_gap_stderr"] is None else f"{top['eta4_gap_stderr']:+.2f}"
    print(f"best correction over η > 0: {top['best_correction']}; η = 4 minus η = 0 with it: {gap} standard errors")
    save(args.out, result, plot(runs, result["cells"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
