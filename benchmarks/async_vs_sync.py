"""Asynchronous (η = 2) against synchronous (η = 0) training through `tandem run`: trained samples/s and the ratio.

    .venv/bin/python -m benchmarks.async_vs_sync                 # simulation, then the real demo (8 steps each)
    .venv/bin/python -m benchmarks.async_vs_sync --quick         # fewer steps in both parts
    .venv/bin/python -m benchmarks.async_vs_sync --part sim      # only the simulation (a minute)
    .venv/bin/python -m benchmarks.async_vs_sync --full          # the real part at the demo's total_steps

SIMULATION part (`run.simulate = true`): generating one batch takes as long as training on it, `--step-s` seconds
each. A batch is B = 4 groups of n = 8 samples; the generator keeps B prompts in flight, so the whole batch
decodes together in one round of `sim_tokens` steps of `sim_token_s` (= step-s); the learner takes
`sim_sample_s` = step-s / (B n) a sample. At η = 0 the two alternate (generate, then train on it, then publish
and only then generate the next): a step costs gen + train = 2 step-s at best. At η = 2 the generator samples
batch k + 1 while the learner trains on batch k: a step costs max(gen, train) = step-s. The theoretical ratio is
(gen + train) / max(gen, train) = 2; the target is >= 1.9. Both runs train the same number of steps; the rate is
taken from the learner's metrics between step WARMUP_STEPS and the last step. Each run's efficiency is its
measured step time against that ideal, and its lost time is split into the learner's own figures (perf/wait_s,
perf/train_s, perf/publish_s).

REAL part: examples/demo.toml (SmolLM2-135M, vLLM generator on one core, DeepSpeed learner on the other) at
η = 0 and η = 2 for `--real-steps` steps (default 8, --quick 4, --full the demo's total_steps): samples/s, reward
against wall time, and the ratio; the learner's wait/train split shows why (η = 0 serialises the two cores) and
bounds what overlap can give: (gen + train) / max(gen, train). On a shared machine other processes may take part
of the learner's core: each run reports the learner's CPU seconds per second of training, a ratio corrected for
it (`ratio_own_core`), and a warning when a learner got less than CONTENDED_BELOW of its core.

Writes results/async_vs_sync.{json,png}. Runs go to a temporary folder unless `--runs-dir` keeps them.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save, side_by_side
from benchmarks.runs import DEMO_CONFIG, RunOutcome, cpu_use, every_core_overrides, launch_run, mean_of, trained_rate
from common.config import load_config

WARMUP_STEPS = 2  # rates are measured from this step's record on (the first batch has nothing to overlap with)
SYNC_ETA, ASYNC_ETA = 0, 2
TARGET_RATIO = 1.9
CONTENDED_BELOW = 0.85  # learner CPU seconds per second of train_step below which a real run was slowed by others
GROUPS_PER_STEP, GROUP_SIZE, SIM_TOKENS = 4, 8, 50
SIM_CONFIG = f"""# async_vs_sync SIMULATION: generating a batch costs as much as training on it (see the benchmark).
[run]
simulate = true
[algo]
group_size = {GROUP_SIZE}
[env]
num_prompts = 4096
[generator]
prompts_in_flight = {GROUPS_PER_STEP}
sim_tokens = {SIM_TOKENS}
drain_timeout_s = 5
[learner]
groups_per_step = {GROUPS_PER_STEP}
"""


def sim_overrides(step_s: float, weights_mb: float) -> dict[str, Any]:
    """Sim costs such that one batch takes `step_s` to generate and `step_s` to train on."""
    return {
        "generator.sim_token_s": step_s / SIM_TOKENS,
        "learner.sim_sample_s": step_s / (GROUPS_PER_STEP * GROUP_SIZE),
        "learner.sim_weights_mb": weights_mb,
        **every_core_overrides(),
    }


def run_summary(outcome: RunOutcome, eta: int) -> dict[str, Any]:
    """Rates, the learner's time split and the staleness seen, of one run (steady state: after WARMUP_STEPS)."""
    records = outcome.records
    return {
        **cpu_use(outcome, WARMUP_STEPS),
        "eta": eta,
        "steps": len(records),
        "wall_s": outcome.wall_s,
        "load_avg": outcome.load_avg,
        **trained_rate(records, WARMUP_STEPS),
        "wait_s": mean_of(records, "perf/wait_s", WARMUP_STEPS),
        "train_s": mean_of(records, "perf/train_s", WARMUP_STEPS),
        "publish_s": mean_of(records, "perf/publish_s", WARMUP_STEPS),
        "staleness_mean": mean_of(records, "staleness/mean"),
        "staleness_max": max((r["staleness/max"] for r in records), default=0),
        "dropped_stale": records[-1].get("buffer/dropped_stale", 0) if records else 0,
        "curve": [
            {
                "step": r["step"],
                "time": r["time"],
                "samples": r["learner/samples_trained"],
                "reward": r.get("reward/mean"),
            }
            for r in records
        ],
    }


def run_pair(config: Path, root: Path, prefix: str, overrides: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """η = 0 then η = 2 with the same config and steps; both summaries and the ratio of their rates."""
    runs = {}
    for eta in (SYNC_ETA, ASYNC_ETA):
        print(f"  {prefix}: η = {eta} ...", flush=True)
        outcome = launch_run(config, root, f"{prefix}-eta{eta}", {**overrides, "algo.max_staleness": eta}, timeout_s)
        runs[f"eta{eta}"] = summary = run_summary(outcome, eta)
        print(
            f"  {prefix}: η = {eta}: {summary['samples_per_s']:.2f} samples/s, {summary['step_s']:.2f} s/step "
            f"(learner waits {summary['wait_s']:.2f} s, trains {summary['train_s']:.2f} s, publishes "
            f"{summary['publish_s']:.3f} s a step), staleness mean {summary['staleness_mean']:.2f} max "
            f"{summary['staleness_max']:.0f}; cores used: learner {summary['learner_cores']:.2f} "
            f"({summary['learner_cpu_per_train_s']:.2f} CPU s per train s), generator "
            f"{summary['generator_cores']:.2f}; load average {outcome.load_avg:.1f}; {outcome.wall_s:.0f} s in all",
            flush=True,
        )
    ratio = runs[f"eta{ASYNC_ETA}"]["samples_per_s"] / runs[f"eta{SYNC_ETA}"]["samples_per_s"]
    return {"runs": runs, "ratio": ratio}


def simulation_part(root: Path, step_s: float, steps: int, weights_mb: float) -> dict[str, Any]:
    config = root / "sim.toml"
    config.write_text(SIM_CONFIG)
    overrides = {**sim_overrides(step_s, weights_mb), "learner.total_steps": steps}
    result = run_pair(config, root, "sim", overrides, timeout_s=120 + 6 * steps * step_s)
    ideal = {f"eta{SYNC_ETA}": 2 * step_s, f"eta{ASYNC_ETA}": step_s}  # seconds a step at best
    for key, run in result["runs"].items():
        run["ideal_step_s"] = ideal[key]
        run["efficiency"] = ideal[key] / run["step_s"]
        run["overhead_s"] = run["step_s"] - ideal[key]
    result.update(
        {
            "gen_batch_s": step_s,
            "train_batch_s": step_s,
            "weights_mb": weights_mb,
            "steps": steps,
            "theoretical_ratio": 2.0,
            "target_ratio": TARGET_RATIO,
            "config": SIM_CONFIG,
            "overrides": overrides,
        }
    )
    print(
        f"SIMULATION: async/sync = {result['ratio']:.2f}x (theory 2x, target >= {TARGET_RATIO}x); "
        f"step overhead over the ideal: sync {result['runs']['eta0']['overhead_s']:+.3f} s, "
        f"async {result['runs']['eta2']['overhead_s']:+.3f} s",
        flush=True,
    )
    return result


def real_part(root: Path, steps: int) -> dict[str, Any]:
    demo = load_config(DEMO_CONFIG)
    overrides = {"learner.total_steps": steps}
    result = run_pair(DEMO_CONFIG, root, "real", overrides, timeout_s=600 + 120 * steps)
    result.update(
        {
            "steps": steps,
            "demo_config": DEMO_CONFIG.read_text(),
            "model": demo.model.path,
            "groups_per_step": demo.learner.groups_per_step,
            "group_size": demo.algo.group_size,
            "max_tokens": demo.generator.max_tokens,
        }
    )
    explain_real(result)
    return result


def explain_real(result: dict[str, Any]) -> None:
    """Add to the real part's result: the bound overlap allows, and the ratio corrected for other load.

    Bound: at η = 0 the learner's wait is the generator's whole batch (+ weight sync) and the two cores never
    overlap, so asynchrony can give at most (gen + train) / max(gen, train). Correction: on a shared machine the
    learner may not get its core; its CPU seconds per second of train_step say how much it got, and
    train_s x that share is the step it would have taken with its core to itself (training is CPU-bound on one
    core). `ratio_own_core` compares the runs with that correction; `contended` says a run got < CONTENDED_BELOW.
    """
    runs = result["runs"]
    sync, asynchronous = runs[f"eta{SYNC_ETA}"], runs[f"eta{ASYNC_ETA}"]
    gen_s, train_s = sync["wait_s"], sync["train_s"] + sync["publish_s"]
    for run in runs.values():
        share = min(1.0, run["learner_cpu_per_train_s"])
        run["step_s_own_core"] = run["wait_s"] + run["train_s"] * share + run["publish_s"]
    result.update(
        {
            "gen_batch_s_at_eta0": gen_s,
            "train_step_s_at_eta0": train_s,
            "ideal_ratio": (gen_s + train_s) / max(gen_s, train_s),
            "ratio_own_core": sync["step_s_own_core"] / asynchronous["step_s_own_core"],
            "contended": min(run["learner_cpu_per_train_s"] for run in runs.values()) < CONTENDED_BELOW,
        }
    )
    print(
        f"REAL (demo, {result['steps']} steps): async/sync = {result['ratio']:.2f}x; at η = 0 a step is "
        f"generation {gen_s:.1f} s + training {train_s:.1f} s, so overlap can give at most "
        f"{result['ideal_ratio']:.2f}x; corrected for the share of its core each learner got: "
        f"{result['ratio_own_core']:.2f}x; reward at the last step: async {asynchronous['curve'][-1]['reward']:.3f}, "
        f"sync {sync['curve'][-1]['reward']:.3f}",
        flush=True,
    )
    if result["contended"]:
        print(
            f"WARNING: a learner got less than {CONTENDED_BELOW:.0%} of its core (other processes on this machine): "
            "the measured ratio reflects their load; rerun on a quiet machine",
            flush=True,
        )


def plot(sim: dict[str, Any] | None, real: dict[str, Any] | None):
    """Panels: simulated samples vs time; real samples vs time; real reward vs time (those that ran)."""

    def draw(axes: Any) -> None:
        panels = [("sim", "samples")] * (sim is not None) + [("real", "samples"), ("real", "reward")] * (
            real is not None
        )
        for ax, (part, key) in zip(side_by_side(axes, len(panels), width=5 * len(panels)), panels):
            result = sim if part == "sim" else real
            for run in result["runs"].values():
                ax.plot(
                    [p["time"] for p in run["curve"]],
                    [p[key] for p in run["curve"]],
                    "o-",
                    markersize=3,
                    label=f"η = {run['eta']}: {run['samples_per_s']:.1f} samples/s",
                )
            ax.set_xlabel("seconds since the learner started")
            ax.set_ylabel("trained samples" if key == "samples" else "reward/mean")
            title = "SIMULATION" if part == "sim" else "real demo (SmolLM2)"
            ax.set_title(f"{title}: async/sync {result['ratio']:.2f}x" if key == "samples" else f"{title}: reward")
            ax.legend(fontsize=8)

    return draw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["sim", "real", "both"], default="both")
    parser.add_argument("--quick", action="store_true", help="fewer steps: sim 12, real 4")
    parser.add_argument("--full", action="store_true", help="real part at the demo config's total_steps")
    parser.add_argument("--step-s", type=float, default=1.0, help="SIMULATION: seconds to generate = to train a batch")
    parser.add_argument("--steps", type=int, default=None, help="SIMULATION: learner steps per run (default 20)")
    parser.add_argument("--weights-mb", type=float, default=16.0, help="SIMULATION: published weights, MiB")
    parser.add_argument("--real-steps", type=int, default=None, help="REAL: learner steps per run (default 8)")
    parser.add_argument("--runs-dir", type=Path, default=None, help="keep the runs here (default: a temp folder)")
    args = parser.parse_args(argv)
    sim_steps = args.steps or (12 if args.quick else 20)
    real_steps = args.real_steps or (
        load_config(DEMO_CONFIG).learner.total_steps if args.full else 4 if args.quick else 8
    )
    if sim_steps <= WARMUP_STEPS + 1 or real_steps <= WARMUP_STEPS:
        parser.error(
            f"--steps must be > {WARMUP_STEPS + 1} and --real-steps > {WARMUP_STEPS} (the rate is "
            f"measured after step {WARMUP_STEPS})"
        )
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="tandem-async-vs-sync-") as tmp:
        root = args.runs_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        sim = simulation_part(root, args.step_s, sim_steps, args.weights_mb) if args.part != "real" else None
        real = real_part(root, real_steps) if args.part != "sim" else None
    headline = {
        "sim_ratio": sim["ratio"] if sim else None,
        "real_ratio": real["ratio"] if real else None,
        "real_ratio_own_core": real["ratio_own_core"] if real else None,
        "target_sim_ratio": TARGET_RATIO,
    }
    print(f"done in {time.time() - started:.0f} s")
    save("async_vs_sync", {"headline": headline, "simulation": sim, "real": real}, plot(sim, real))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
