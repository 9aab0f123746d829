"""Fleet scaling, SIMULATION mode: trained samples/s with G generators and L learner ranks against the capacity
that the simulated costs allow, and the buffer's CPU per sample as G grows.

    .venv/bin/python -m benchmarks.fleet_scaling               # G in 1 2 4 8 16 32, L in 1 2 (~10 min)
    .venv/bin/python -m benchmarks.fleet_scaling --quick       # G in 1 4 16, L in 1 2, shorter windows
    .venv/bin/python -m benchmarks.fleet_scaling --generators 1 8 --ranks 2 --window-s 30

Each point is one `tandem run --run.simulate true --generator.count G --learner.world_size L` (every role may use
every core: simulated roles stand for separate machines). The costs are sleep-dominated on purpose: a simulated
generator sleeps `sim_token_s` per decode step and the simulated learner sleeps its compute, so 32 generator
processes on 2 cores measure the pipeline (sockets, leases, admission, weight polls), not CPU contention; the
roles' CPU use is reported beside each point to show that it stays well under the machine.

Capacities (samples/s), from the simulated costs:
    generation  G x prompts_in_flight x group_size / (sim_tokens x sim_token_s)
                (each generator decodes its prompts_in_flight x group_size sequences together, one round of
                sim_tokens steps, then leases the next prompts)
    training    world_size / sim_sample_s  (the sim trainer divides its cost by world_size)
Efficiency = achieved / min(generation, training). The crossover lies off the grid points (G = 2.5 for L = 1,
5 for L = 2), so every point is bound by one side by >= 20%. The formulas are checked first, against what one
generator achieves with a free learner (sim_sample_s = 0) and what the learner achieves with free generation
(sim_token_s = 0): `calibration` in the JSON, measured / formula. Target: efficiency >= 0.95 at every point.
With the calibration, each point also gets `scaling_efficiency`: achieved / min(G x the measured rate of one
generator, the measured rate of the learner), what coupling the fleet costs beyond the stand-ins' own losses.

Steady state: from the first learner step whose record appeared after every generator had opened its metrics
stream (its loop runs), plus one step, to the last step, cut to whole periods of rounds vs batches when
generation-bound (`batch_period_steps`); `total_steps` is sized for `--window-s` seconds of it after the
estimated start-up. Buffer CPU per sample: the buffer process's CPU seconds (/proc/<pid>/stat) over
the same window, divided by the samples trained in it. Writes results/fleet_scaling.{json,png}.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save, side_by_side
from benchmarks.runs import RunOutcome, every_core_overrides, launch_run, trained_rate

TARGET_EFFICIENCY = 0.95
GROUP_SIZE, GROUPS_PER_STEP = 8, 20  # 160 samples a step
PROMPTS_IN_FLIGHT, SIM_TOKENS, SIM_TOKEN_S = 4, 10, 0.1  # one generator: 32 samples a 1 s round = 32 samples/s
SIM_SAMPLE_S = 1 / 80  # one rank trains 80 samples/s: a step takes 2 s at L = 1, 1 s at L = 2
WEIGHTS_MB = 269_030_016 / 2**20  # the embedded model's real weights (SmolLM2-135M bf16: 256.6 MiB) every sync
MIN_WINDOW_STEPS = 4
STARTUP_S = {"base": 5.0, "per_generator": 0.3}  # start-up estimate that sizes total_steps (2 shared cores)
SIM_CONFIG = f"""# fleet_scaling SIMULATION (see the benchmark's docstring); G and L come as overrides.
[run]
simulate = true
[algo]
group_size = {GROUP_SIZE}
max_staleness = 2
[env]
num_prompts = 100000
[generator]
prompts_in_flight = {PROMPTS_IN_FLIGHT}
sim_tokens = {SIM_TOKENS}
sim_token_s = {SIM_TOKEN_S}
drain_timeout_s = 5
[buffer]
capacity = 4096
[learner]
groups_per_step = {GROUPS_PER_STEP}
sim_sample_s = {SIM_SAMPLE_S}
sim_weights_mb = {WEIGHTS_MB}
"""


def generation_capacity(generators: int, sim_token_s: float = SIM_TOKEN_S) -> float:
    """Samples/s that `generators` simulated generators produce when never refused (inf when sim_token_s = 0)."""
    round_s = SIM_TOKENS * sim_token_s
    return math.inf if round_s == 0 else generators * PROMPTS_IN_FLIGHT * GROUP_SIZE / round_s


def training_capacity(world_size: int, sim_sample_s: float = SIM_SAMPLE_S) -> float:
    """Samples/s the simulated learner trains when never kept waiting (inf when sim_sample_s = 0)."""
    return math.inf if sim_sample_s == 0 else world_size / sim_sample_s


def batch_period_steps(generators: int) -> int:
    """Learner steps after which the rounds of G generators in lock-step and the batches line up again:
    G x prompts_in_flight groups a round, groups_per_step a step -> lcm / groups_per_step steps.

    Generation-bound, a batch completes only at the end of a round, so a window cut mid-period over- or
    under-counts up to a round (with G = 2: 8 groups a round, 20 a step, steps alternate 3 and 2 rounds); a
    window of whole periods does not. Training-bound there is a backlog and no such quantisation (period 1)."""
    per_round = generators * PROMPTS_IN_FLIGHT
    return per_round // math.gcd(per_round, GROUPS_PER_STEP)


def total_steps(expected_rate: float, generators: int, window_s: float, period: int) -> int:
    """Steps that last the estimated start-up plus `window_s` of steady state at `expected_rate` samples/s:
    at least MIN_WINDOW_STEPS and at least one `period`, plus two to spare."""
    startup_s = STARTUP_S["base"] + STARTUP_S["per_generator"] * generators
    step_s = GROUPS_PER_STEP * GROUP_SIZE / expected_rate
    return math.ceil(startup_s / step_s) + max(MIN_WINDOW_STEPS, period, math.ceil(window_s / step_s)) + 2


def steady_window(outcome: RunOutcome, period: int) -> tuple[int, int]:
    """(first step, last step) of the steady state (see the module docstring), cut to whole `period`s."""
    ready = outcome.generators_ready_wall
    if ready is None:
        raise RuntimeError(f"{outcome.name}: the generators never all opened their metrics streams")
    first = outcome.first_step_after(ready) + 1
    last = first + (max(outcome.step_wall) - first) // period * period
    if last - first < max(period, MIN_WINDOW_STEPS // 2):
        raise RuntimeError(
            f"{outcome.name}: only {last - first} steps of steady state after every generator started; raise --window-s"
        )
    return first, last


def measure_point(
    root: Path, config: Path, generators: int, ranks: int, window_s: float, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One run; its rate, efficiency against the formula capacities, and CPU per role over the steady state."""
    extra = overrides or {}
    gen_cap = generation_capacity(generators, extra.get("generator.sim_token_s", SIM_TOKEN_S))
    train_cap = training_capacity(ranks, extra.get("learner.sim_sample_s", SIM_SAMPLE_S))
    bound = min(gen_cap, train_cap)
    period = batch_period_steps(generators) if gen_cap < train_cap else 1
    steps = total_steps(bound, generators, window_s, period)
    name = "-".join([f"g{generators}-l{ranks}", *(f"{key.split('.')[-1]}{value}" for key, value in extra.items())])
    settings = {
        "generator.count": generators,
        "learner.world_size": ranks,
        "learner.total_steps": steps,
        **every_core_overrides(),
        **extra,
    }
    outcome = launch_run(config, root, name, settings, timeout_s=300 + 3 * steps)
    first, last = steady_window(outcome, period)
    start_wall, end_wall = outcome.step_wall[first], outcome.step_wall[last]
    rate = trained_rate(outcome.records, first, last)
    window = end_wall - start_wall
    cpu = {role: outcome.cpu_between(role, start_wall, end_wall) for role in ("buffer", "learner", "generator")}
    final = outcome.records[-1]
    return {
        "generators": generators,
        "world_size": ranks,
        "total_steps": steps,
        "window_steps": [first, last],
        "generation_capacity": gen_cap,
        "training_capacity": train_cap,
        "bound": "generation" if gen_cap < train_cap else "training",
        "samples_per_s": rate["samples_per_s"],
        "efficiency": rate["samples_per_s"] / bound,
        "window_s": rate["window_s"],
        "window_samples": rate["window_samples"],
        "buffer_cpu_s_per_sample": cpu["buffer"] / rate["window_samples"],
        "cpu_share": {role: seconds / window for role, seconds in cpu.items()},  # cores used, on average
        "dropped_stale": final.get("buffer/dropped_stale", 0),
        "staleness_max": max(r["staleness/max"] for r in outcome.records),
        "wall_s": outcome.wall_s,
        "load_avg": outcome.load_avg,
    }


def calibrate(root: Path, config: Path, window_s: float) -> dict[str, Any]:
    """The capacity formulas against one side running alone (the other side's cost set to zero). Beside each
    ratio: the fixed time the side spends per unit of work beyond its simulated cost (`fixed_s`: per generation
    round for the generator, per step for the learner), which is what bounds efficiency: 1 - fixed / unit."""
    per_round, per_step = PROMPTS_IN_FLIGHT * GROUP_SIZE, GROUPS_PER_STEP * GROUP_SIZE
    generator = measure_point(root, config, 1, 1, window_s, {"learner.sim_sample_s": 0})
    checks = {
        "one_generator": {
            "formula": generation_capacity(1),
            "measured": generator["samples_per_s"],
            "unit_s": SIM_TOKENS * SIM_TOKEN_S,
            "samples_per_unit": per_round,
        }
    }
    for ranks in (1, 2):
        learner = measure_point(root, config, 4, ranks, window_s, {"generator.sim_token_s": 0})
        checks[f"learner_world_size_{ranks}"] = {
            "formula": training_capacity(ranks),
            "measured": learner["samples_per_s"],
            "unit_s": per_step / training_capacity(ranks),
            "samples_per_unit": per_step,
        }
    for name, check in checks.items():
        check["measured_over_formula"] = check["measured"] / check["formula"]
        check["fixed_s"] = check.pop("samples_per_unit") / check["measured"] - check["unit_s"]
        print(
            f"  calibration {name}: measured {check['measured']:.1f} samples/s, formula {check['formula']:.1f} "
            f"({check['measured_over_formula']:.3f}): {1e3 * check['fixed_s']:.0f} ms fixed per "
            f"{check['unit_s']:.2f} s {'round' if name == 'one_generator' else 'step'}",
            flush=True,
        )
    return checks


def add_scaling_efficiency(rows: list[dict[str, Any]], calibration: dict[str, Any]) -> None:
    """Give each row `scaling_efficiency`: achieved / min(G x one generator's measured rate, the learner's measured
    rate). The target is on `efficiency` (against the formulas); this second figure separates what coupling G
    generators to L ranks loses from what one simulated stand-in loses by itself (its `fixed_s` per unit)."""
    one_generator = calibration["one_generator"]["measured"]
    for row in rows:
        learner = calibration.get(f"learner_world_size_{row['world_size']}")
        training = learner["measured"] if learner else row["training_capacity"]
        row["scaling_efficiency"] = row["samples_per_s"] / min(row["generators"] * one_generator, training)


def wakeup_cost_us(sleep_s: float = SIM_TOKEN_S, repeats: int = 30) -> dict[str, float]:
    """Median µs of one simulated decode step's own work (two small numpy draws) run hot, and run right after
    sleeping `sleep_s`. On this VM the second is 100-300x the first: every wake-up of a sleeping process pays it,
    and a simulated pipeline is all wake-ups (each engine step, each request to a sleeping peer), so it bounds the
    fixed cost per round and per step that the calibration measures."""
    import numpy as np

    rng = np.random.default_rng(0)

    def median_us(pause_s: float) -> float:
        times = []
        for _ in range(repeats):
            if pause_s:
                time.sleep(pause_s)
            start = time.perf_counter()
            rng.integers(0, 49152, size=32), rng.exponential(2.0, size=32)
            times.append(time.perf_counter() - start)
        return float(np.median(times)) * 1e6

    return {"hot_us": median_us(0.0), "after_sleep_us": median_us(sleep_s), "sleep_s": sleep_s}


def plot(rows: list[dict[str, Any]]):
    def draw(axes: Any) -> None:
        rate_ax, cpu_ax = side_by_side(axes, 2, width=12)
        for ranks, marker in ((1, "o"), (2, "s")):
            points = [row for row in rows if row["world_size"] == ranks]
            if not points:
                continue
            counts = [row["generators"] for row in points]
            line = rate_ax.plot(counts, [row["samples_per_s"] for row in points], marker + "-", label=f"L = {ranks}")
            rate_ax.plot(
                counts,
                [min(row["generation_capacity"], row["training_capacity"]) for row in points],
                ":",
                color=line[0].get_color(),
                label=f"capacity, L = {ranks}",
            )
            for row in points:  # efficiency: under the L = 1 points, over the L = 2 points
                rate_ax.annotate(
                    f"{row['efficiency']:.2f}",
                    (row["generators"], row["samples_per_s"]),
                    textcoords="offset points",
                    xytext=(0, -12 if ranks == 1 else 6),
                    ha="center",
                    fontsize=7,
                )
            cpu_ax.plot(
                counts, [1e6 * row["buffer_cpu_s_per_sample"] for row in points], marker + "-", label=f"L = {ranks}"
            )
        counts = sorted({row["generators"] for row in rows})
        for ax in (rate_ax, cpu_ax):
            ax.set_xscale("log", base=2)
            ax.set_xticks(counts, [str(count) for count in counts])
            ax.set_xlabel("generators G")
            ax.legend(fontsize=8)
        rate_ax.set_ylabel("trained samples/s (efficiency under each point)")
        rate_ax.set_title("SIMULATION: throughput vs capacity")
        cpu_ax.set_ylabel("buffer CPU µs per trained sample")
        cpu_ax.set_title("buffer CPU per sample")

    return draw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="G in 1 4 16, 10 s windows, no calibration")
    parser.add_argument("--generators", type=int, nargs="+", default=None, help="default 1 2 4 8 16 32")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="learner world sizes")
    parser.add_argument("--window-s", type=float, default=None, help="steady-state seconds per point (default 15)")
    parser.add_argument("--no-calibration", action="store_true", help="skip checking the capacity formulas")
    parser.add_argument("--runs-dir", type=Path, default=None, help="keep the runs here (default: a temp folder)")
    args = parser.parse_args(argv)
    counts = args.generators or ([1, 4, 16] if args.quick else [1, 2, 4, 8, 16, 32])
    window_s = args.window_s or (10.0 if args.quick else 15.0)
    started = time.time()
    wakeup = wakeup_cost_us()
    print(
        f"this machine: a decode step's own work takes {wakeup['hot_us']:.0f} µs hot, {wakeup['after_sleep_us']:.0f} "
        f"µs right after a {wakeup['sleep_s']:.2f} s sleep (the cost of waking up)",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tandem-fleet-") as tmp:
        root = args.runs_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        config = root / "fleet.toml"
        config.write_text(SIM_CONFIG)
        calibration = None if (args.quick or args.no_calibration) else calibrate(root, config, window_s)
        for ranks in args.ranks:
            for generators in counts:
                row = measure_point(root, config, generators, ranks, window_s)
                rows.append(row)
                print(
                    f"G={generators:>2} L={ranks}  {row['samples_per_s']:6.1f} samples/s of "
                    f"{min(row['generation_capacity'], row['training_capacity']):6.1f} ({row['bound']}-bound)  "
                    f"efficiency {row['efficiency']:.3f}  buffer {1e6 * row['buffer_cpu_s_per_sample']:.0f} "
                    f"µs CPU/sample  cores used: generators {row['cpu_share']['generator']:.2f}, buffer "
                    f"{row['cpu_share']['buffer']:.2f}, learner {row['cpu_share']['learner']:.2f}  "
                    f"({row['wall_s']:.0f} s, load {row['load_avg']:.1f})",
                    flush=True,
                )
    worst = min(rows, key=lambda row: row["efficiency"])
    print(
        f"lowest efficiency {worst['efficiency']:.3f} at G={worst['generators']} L={worst['world_size']} "
        f"(target >= {TARGET_EFFICIENCY}); {time.time() - started:.0f} s in all"
    )
    headline = {
        "min_efficiency": worst["efficiency"],
        "target_efficiency": TARGET_EFFICIENCY,
        "buffer_us_per_sample_max_g": 1e6 * max(rows, key=lambda r: r["generators"])["buffer_cpu_s_per_sample"],
    }
    if calibration is not None:
        add_scaling_efficiency(rows, calibration)
        scaling_worst = min(rows, key=lambda row: row["scaling_efficiency"])
        headline["min_scaling_efficiency"] = scaling_worst["scaling_efficiency"]
        print(
            f"against the calibrated capacities (what one generator, one learner achieve alone): lowest "
            f"{scaling_worst['scaling_efficiency']:.3f} at G={scaling_worst['generators']} "
            f"L={scaling_worst['world_size']}"
        )
    wakeup_end = wakeup_cost_us()
    result = {
        "headline": headline,
        "config": SIM_CONFIG,
        "window_s": window_s,
        "calibration": calibration,
        "wakeup_cost": {"start": wakeup, "end": wakeup_end},
        "rows": rows,
    }
    save("fleet_scaling", result, plot(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
