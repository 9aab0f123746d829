"""Evaluation during training against none: the learner's step rate with [eval] on and off (SIMULATION).

    .venv/bin/python -m benchmarks.eval_overhead                 # 3 runs off and 3 on, alternating (~4 min)
    .venv/bin/python -m benchmarks.eval_overhead --quick         # 2 + 2 shorter runs
    .venv/bin/python -m benchmarks.eval_overhead --repeats 5 --steps 40 --runs-dir /tmp/eval-overhead

Issue 16 asks that the learner never wait for evaluation: with generation headroom, its step rate with eval on
is that with eval off, within noise. Every run is `tandem run` in simulation (`run.simulate = true`: the buffer,
the sockets, the leases and the eval rounds are real; the engine and the trainer are stand-ins of configured
cost), with the same seed and the same config but for the [eval] section. The learner's step costs `--step-s`
(B = 4 groups of n = 8 samples at sim_sample_s = step-s / (B n)); the one generator keeps 8 prompts in flight
and decodes a round of 64 sequences in SIM_TOKENS steps of `sim_token_s` = step-s / 100, so a training batch
takes 16% of a step to generate: the generator idles most of the time (headroom). With eval on, every EVAL_EVERY
versions the buffer opens a round of two sets (`arithmetic`, 19 prompts, and `arithmetic-d2`, EVAL_PROMPTS),
each prompt sampled greedy + EVAL_SAMPLES times: ~2 x 2 engine rounds of 64 sequences per eval round, which the
headroom absorbs. The runs go one after another, off and on alternating (off, on, off, on, ...), so that slow
drift of the machine's load falls on both.

Figures per run: the learner's steps/s from step WARMUP_STEPS to its last step (learner clock, metrics.jsonl; the
final eval round comes after the last step and is not in it), the eval rows written (eval.jsonl), the eval leases
issued and the eval accounting identity (the buffer's last record). Headline: mean steps/s off and on,
`step_rate_ratio` = on / off, and the noise: the spread (max - min) / mean of the off runs' rates, which a ratio
within 1 +- that spread cannot be told from. Writes results/eval_overhead.json.

Failure modes: a run that fails or outlives its timeout raises `benchmarks.runs.RunFailed` with its output's tail;
an eval-on run without eval rows, or whose eval identity does not hold, is reported (`eval_identity_holds` false,
`eval_rows` 0) rather than hidden. On a machine shared with other jobs the rates move with their load: the
load average at each run's end is recorded.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save
from benchmarks.runs import RunOutcome, every_core_overrides, launch_run, trained_rate
from common.metrics import read_metrics

WARMUP_STEPS = 2  # the rate is taken from this step's record on (the first batches wait for the generator)
GROUPS_PER_STEP, GROUP_SIZE, SIM_TOKENS, PROMPTS_IN_FLIGHT = 4, 8, 16, 8
TOKEN_S_PER_STEP_S = 0.01  # sim_token_s = step-s / 100: a training batch's round of SIM_TOKENS takes 16% of a step
EVAL_SETS = ("arithmetic", "arithmetic-d2")
EVAL_EVERY, EVAL_PROMPTS, EVAL_SAMPLES = 4, 20, 4
BASE_CONFIG = f"""# eval_overhead SIMULATION: a learner-bound run (the generator idles); see the benchmark.
[run]
simulate = true
[algo]
group_size = {GROUP_SIZE}
max_staleness = 2
[env]
num_prompts = 4096
[generator]
prompts_in_flight = {PROMPTS_IN_FLIGHT}
sim_tokens = {SIM_TOKENS}
drain_timeout_s = 5
[learner]
groups_per_step = {GROUPS_PER_STEP}
"""
EVAL_SECTION = f"""[eval]
sets = {list(EVAL_SETS)!r}
every = {EVAL_EVERY}
at_end = true
greedy = true
samples = {EVAL_SAMPLES}
max_prompts = {EVAL_PROMPTS}
"""
IDENTITY = ("eval_issued", "eval_done", "eval_requeued", "eval_outstanding")


def sim_overrides(step_s: float, steps: int) -> dict[str, Any]:
    """A learner step of `step_s`, a generator round of SIM_TOKENS tokens at step_s x TOKEN_S_PER_STEP_S each."""
    return {
        "generator.sim_token_s": step_s * TOKEN_S_PER_STEP_S,
        "learner.sim_sample_s": step_s / (GROUPS_PER_STEP * GROUP_SIZE),
        "learner.sim_weights_mb": 4.0,
        "learner.total_steps": steps,
        **every_core_overrides(),
    }


def run_figures(outcome: RunOutcome, eval_on: bool) -> dict[str, Any]:
    """Steps/s after WARMUP_STEPS, the eval rows and leases, and the eval identity (buffer's last record)."""
    rate = trained_rate(outcome.records, WARMUP_STEPS)
    last = outcome.buffer_records[-1] if outcome.buffer_records else {}
    counts = {key: int(last.get(f"buffer/{key}", 0) or 0) for key in (*IDENTITY, "eval_leases_issued")}
    eval_path = outcome.run_dir / "eval.jsonl"
    rows = read_metrics(eval_path) if eval_path.exists() else []
    return {
        "eval": eval_on,
        "steps": len(outcome.records),
        "steps_per_s": 1.0 / rate["step_s"],
        "step_s": rate["step_s"],
        "samples_per_s": rate["samples_per_s"],
        "wall_s": outcome.wall_s,
        "load_avg": outcome.load_avg,
        "eval_rows": len(rows),
        "eval_versions": sorted({int(row["step"]) for row in rows}),
        "eval_leases_issued": counts["eval_leases_issued"],
        "eval_counters": {key: counts[key] for key in IDENTITY},
        "eval_identity_holds": counts["eval_issued"]
        == counts["eval_done"] + counts["eval_requeued"] + counts["eval_outstanding"],
    }


def measure(root: Path, repeats: int, step_s: float, steps: int) -> list[dict[str, Any]]:
    """`repeats` runs off and `repeats` on, alternating, one after another; their figures in run order."""
    configs = {False: root / "eval_off.toml", True: root / "eval_on.toml"}
    configs[False].write_text(BASE_CONFIG)
    configs[True].write_text(BASE_CONFIG + EVAL_SECTION)
    overrides = sim_overrides(step_s, steps)
    timeout_s = 120 + 6 * steps * step_s
    runs = []
    for repeat in range(repeats):
        for eval_on in (False, True):
            name = f"eval-{'on' if eval_on else 'off'}-{repeat}"
            outcome = launch_run(configs[eval_on], root, name, overrides, timeout_s)
            figures = {"name": name, **run_figures(outcome, eval_on)}
            runs.append(figures)
            print(
                f"  {name}: {figures['steps_per_s']:.3f} steps/s ({figures['step_s']:.3f} s/step over steps "
                f"{WARMUP_STEPS}-{figures['steps']}), eval rows {figures['eval_rows']} at versions "
                f"{figures['eval_versions']}, eval leases {figures['eval_leases_issued']}, identity "
                f"{'holds' if figures['eval_identity_holds'] else 'BROKEN'} {figures['eval_counters']}; "
                f"{figures['wall_s']:.0f} s in all, load average {figures['load_avg']:.1f}",
                flush=True,
            )
    return runs


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The headline of a saved result (its `runs` and `step_s`): mean rates off and on, their ratio, the spreads."""
    runs, step_s = result["runs"], result["step_s"]
    off = [run["steps_per_s"] for run in runs if not run["eval"]]
    on = [run["steps_per_s"] for run in runs if run["eval"]]
    mean_off, mean_on = statistics.fmean(off), statistics.fmean(on)
    return {
        "step_rate_ratio": mean_on / mean_off,
        "steps_per_s_off": mean_off,
        "steps_per_s_on": mean_on,
        "ideal_steps_per_s": 1.0 / step_s,
        "off_spread": (max(off) - min(off)) / mean_off,
        "on_spread": (max(on) - min(on)) / mean_on,
        "eval_rows_per_on_run": statistics.fmean(run["eval_rows"] for run in runs if run["eval"]),
        "eval_leases_per_on_run": statistics.fmean(run["eval_leases_issued"] for run in runs if run["eval"]),
        "eval_identity_holds": all(run["eval_identity_holds"] for run in runs),
        "repeats": len(off),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats of 16 steps")
    parser.add_argument("--repeats", type=int, default=None, help="runs off and runs on, each (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="learner steps per run (default 24)")
    parser.add_argument("--step-s", type=float, default=0.5, help="SIMULATION: seconds of a learner step")
    parser.add_argument("--runs-dir", type=Path, default=None, help="keep the runs here (default: a temp folder)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 3)
    steps = args.steps or (16 if args.quick else 24)
    if steps <= WARMUP_STEPS + 1 or repeats < 1:
        parser.error(
            f"--steps must be > {WARMUP_STEPS + 1} (the rate is measured after step {WARMUP_STEPS}), --repeats >= 1"
        )
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="tandem-eval-overhead-") as tmp:
        root = args.runs_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        runs = measure(root, repeats, args.step_s, steps)
    result = {
        "runs": runs,
        "step_s": args.step_s,
        "steps": steps,
        "warmup_steps": WARMUP_STEPS,
        "config": BASE_CONFIG,
        "eval_section": EVAL_SECTION,
        "overrides": sim_overrides(args.step_s, steps),
    }
    figures = headline(result)
    print(
        f"SIMULATION: eval on / off step rate = {figures['step_rate_ratio']:.3f} "
        f"({figures['steps_per_s_on']:.3f} vs {figures['steps_per_s_off']:.3f} steps/s, ideal "
        f"{figures['ideal_steps_per_s']:.3f}); spread of the off runs {figures['off_spread']:.1%}, of the on runs "
        f"{figures['on_spread']:.1%}; {figures['eval_rows_per_on_run']:.1f} eval rows and "
        f"{figures['eval_leases_per_on_run']:.1f} eval leases a run; eval identity "
        f"{'holds' if figures['eval_identity_holds'] else 'BROKEN'}; done in {time.time() - started:.0f} s",
        flush=True,
    )
    save("eval_overhead", {"headline": figures, **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
