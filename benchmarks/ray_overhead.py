"""What `tandem ray` costs over `tandem run`: trained samples/s against the generator count, SIMULATION mode.

    .venv/bin/python -m benchmarks.ray_overhead [--generators 1 2 4 8 16] [--seconds 12] [--repeats 1]

The same simulated run under both launchers, for each generator count G: one generator makes ~50 samples/s
(continuous batching of prompts_in_flight x group_size = 8 sequences, 16 tokens of 10 ms), the learner takes
2.5 ms a sample (~400 samples/s at most), so throughput should follow G until the learner is the bottleneck.
`tandem run` gets every core for every role (`--generator.cpu_cores` / `--learner.cpu_cores` = all), as Ray
places them unpinned; `tandem ray` starts its own local Ray (no dashboard, 100 MB object store) whose
reservations (0.1 CPU a role) fit the 16 generators. Sockets bind loopback in both.

Figure: trained samples per second of wall time from the learner's metrics.jsonl (`learner/samples_trained`
and `time`) over the second half of the steps, when every generator has long started (starting 16 processes,
or 16 Ray workers and their roles, on 2 cores takes seconds, and the learner trains meanwhile); the run is
sized so that this half lasts about `--seconds`. Overhead = 1 - ray / local. Writes
results/ray_overhead.{json,png}.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save
from benchmarks.runs import every_core_overrides, trained_rate
from common.metrics import read_metrics
from launch.testing import free_port, loopback_overrides, override_args

GROUPS_PER_STEP, GROUP_SIZE = 8, 4
GENERATOR_SAMPLES_S, LEARNER_SAMPLES_S = 50.0, 400.0  # what the sim costs below amount to
CONFIG = f"""
[run]
simulate = true
[algo]
group_size = {GROUP_SIZE}
max_staleness = 2
[env]
num_prompts = 100000
[generator]
sim_token_s = 0.01
sim_tokens = 16
prompts_in_flight = 2
drain_timeout_s = 5
[buffer]
capacity = 4096
[learner]
groups_per_step = {GROUPS_PER_STEP}
sim_sample_s = {1 / LEARNER_SAMPLES_S}
sim_weights_mb = 0.25
[ray]
buffer_cpus = 0.1
learner_cpus = 0.1
generator_cpus = 0.1
dashboard = false
object_store_mb = 100
"""


def total_steps(generators: int, seconds: float) -> int:
    """Steps whose second half lasts about `seconds` at the rate the sim costs allow."""
    expected = min(GENERATOR_SAMPLES_S * generators, LEARNER_SAMPLES_S)
    return 2 * math.ceil(expected * seconds / (GROUPS_PER_STEP * GROUP_SIZE))


def launch(launcher: str, config: Path, root: Path, name: str, generators: int, steps: int) -> float:
    """Run one simulated training under `tandem run` or `tandem ray`; its steady-state trained samples/s."""
    argv = [
        sys.executable,
        "-m",
        "launch.cli",
        launcher,
        str(config),
        "--run.root",
        str(root),
        "--run.name",
        name,
        "--generator.count",
        str(generators),
        "--learner.total_steps",
        str(steps),
    ]
    if launcher == "run":
        argv += override_args({**loopback_overrides(free_port(), free_port()), **every_core_overrides()})
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}  # always a fresh local Ray
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"tandem {launcher} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    records = read_metrics(root / name / "metrics.jsonl")
    return trained_rate(records, int(records[len(records) // 2 - 1]["step"]))["samples_per_s"]


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The figures issues quote: the largest overhead of `tandem ray` over `tandem run` (target <= 5%), per G."""
    by_generators = {f"overhead_g{row['generators']}": row["overhead"] for row in result["rows"]}
    return {"largest_overhead": result["largest_overhead"], "target_overhead": 0.05, **by_generators}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--generators", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured (steady-state) seconds per run")
    parser.add_argument("--repeats", type=int, default=1, help="runs per launcher and count (median reported)")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    started, load_before = time.time(), os.getloadavg()  # the CPU is shared: the load says how noisy it was
    with tempfile.TemporaryDirectory(prefix="tandem-ray-bench-") as tmp:
        root = Path(tmp)
        config = root / "sim.toml"
        config.write_text(CONFIG)
        for generators in args.generators:
            steps = total_steps(generators, args.seconds)
            rates: dict[str, list[float]] = {"run": [], "ray": []}
            for repeat in range(args.repeats):
                for launcher in ("run", "ray"):  # alternating, so slow drift of the machine hits both
                    name = f"{launcher}-g{generators}-r{repeat}"
                    rates[launcher].append(launch(launcher, config, root, name, generators, steps))
            local, ray = (sorted(rates[k])[len(rates[k]) // 2] for k in ("run", "ray"))
            row = {
                "generators": generators,
                "steps": steps,
                "local_samples_s": local,
                "ray_samples_s": ray,
                "overhead": 1 - ray / local,
                "local_runs": rates["run"],
                "ray_runs": rates["ray"],
            }
            rows.append(row)
            print(
                f"G={generators:>2}  tandem run {local:7.1f} samples/s   tandem ray {ray:7.1f} samples/s   "
                f"overhead {100 * row['overhead']:+5.1f}%   ({steps} steps)",
                flush=True,
            )
    worst = max(row["overhead"] for row in rows)
    load = {"before": load_before, "after": os.getloadavg()}
    print(
        f"largest overhead {100 * worst:+.1f}% (target <= 5%); {time.time() - started:.0f}s in all; "
        f"load average {load['before'][0]:.1f} -> {load['after'][0]:.1f} on {os.cpu_count()} cores"
    )

    def plot(axes: Any) -> None:
        counts = [row["generators"] for row in rows]
        axes.plot(counts, [row["local_samples_s"] for row in rows], "o-", label="tandem run (local processes)")
        axes.plot(counts, [row["ray_samples_s"] for row in rows], "s--", label="tandem ray (Ray actors)")
        axes.plot(
            counts,
            [min(GENERATOR_SAMPLES_S * g, LEARNER_SAMPLES_S) for g in counts],
            ":",
            color="grey",
            label="sim cost bound",
        )
        axes.set_xscale("log", base=2)
        axes.set_xticks(counts, [str(c) for c in counts])
        axes.set_xlabel("generators")
        axes.set_ylabel("trained samples/s")
        axes.set_title("SIMULATION: launcher overhead (2-core machine)")
        axes.legend()

    result = {
        "config": CONFIG,
        "measured": "second half of the steps",
        "seconds": args.seconds,
        "load_average": load,
        "rows": rows,
        "largest_overhead": worst,
    }
    save("ray_overhead", {"headline": headline(result), **result}, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
