"""A SIMULATION fleet through a real Slurm, end to end: `tandem slurm CONFIG --submit` on the single-node cluster of
benchmarks/slurm_lab.py, until every job has ended; wall time from submission, and what each job did.

    .venv/bin/python -m benchmarks.slurm_run                  # 8 steps, 2 generators (root; slurm-wlm installed)
    .venv/bin/python -m benchmarks.slurm_run --steps 20 --generators 4

The fleet is the demo's config in SIMULATION (sockets, leases, staleness and the buffer real; vLLM and DeepSpeed
replaced by stand-ins of configured cost), run.insecure on the node's loopback (`slurm.address_command = "echo
127.0.0.1"`: one node). Saved: results/slurm_run.json (headline: seconds from submission to the last job's end).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import save
from benchmarks.slurm_lab import jobs_left, slurm_lab
from common.metrics import read_metrics

RUN = "slurm-sim"


def fleet_overrides(root: Path, steps: int, generators: int) -> list[str]:
    values = {
        "run.simulate": "true",
        "run.insecure": "true",
        "run.root": str(root),
        "run.name": RUN,
        "learner.total_steps": str(steps),
        "learner.sim_sample_s": "0.01",
        "learner.sim_weights_mb": "1",
        "generator.count": str(generators),
        "generator.sim_token_s": "0.005",
        "slurm.address_command": '"echo 127.0.0.1"',
        "slurm.wait_s": "120",
    }
    return [arg for key, value in values.items() for arg in (f"--{key}", value)]


def run_on_slurm(
    root: Path,
    steps: int,
    generators: int,
    env: dict[str, str],
    timeout_s: float = 300,
    after_submit: Callable[[Path], None] | None = None,
) -> dict:
    """Submit the fleet, call `after_submit(slurm_dir)` (more generators, say), wait for every job to end; what
    happened (see `summary`)."""
    argv = [sys.executable, "-m", "launch.cli", "slurm", "demo", "--submit", *fleet_overrides(root, steps, generators)]
    started = time.monotonic()
    submitted = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if submitted.returncode != 0:
        raise RuntimeError(f"tandem slurm --submit exited {submitted.returncode}:\n{submitted.stderr[-3000:]}")
    if after_submit is not None:
        after_submit(root / RUN / "slurm")
    deadline = started + timeout_s
    while jobs_left(env, RUN):
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs of {RUN} still queued or running after {timeout_s:g}s: {jobs_left(env, RUN)}")
        time.sleep(0.5)
    return summary(root / RUN, time.monotonic() - started, submitted.stdout)


def summary(run_dir: Path, wall_s: float, submit_output: str) -> dict[str, Any]:
    outputs = {path.name: path.read_text(errors="replace") for path in sorted((run_dir / "slurm").glob("*.out"))}
    records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    return {
        "wall_s": round(wall_s, 1),
        "steps": [record["step"] for record in records],
        "learner_done": any("tandem: done:" in text for name, text in outputs.items() if name.startswith("learner")),
        "buffer_stopped": any(
            "buffer stopped (run over" in text for n, text in outputs.items() if n.startswith("buffer")
        ),
        "generators_exited": sum(" exits: " in text for name, text in outputs.items() if name.startswith("generators")),
        "errors": {
            name: [ln for ln in text.splitlines() if " E [" in ln or "Traceback" in ln]
            for name, text in outputs.items()
        },
        "submit_output": submit_output.strip(),
        "outputs": sorted(outputs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--generators", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tandem-slurm-run-") as root, slurm_lab() as env:
        result = run_on_slurm(Path(root), args.steps, args.generators, env)
    saved = {"steps": args.steps, "generators": args.generators, "run": result}
    ok = headline(saved)["ok"]
    print(
        f"slurm run: {len(result['steps'])} steps, {result['generators_exited']} generators exited, "
        f"{result['wall_s']} s from submission to the last job's end ({'ok' if ok else 'FAILED'})"
    )
    save("slurm_run", {"headline": headline(saved), **saved})
    return 0 if ok else 1


def headline(result: dict[str, Any]) -> dict[str, Any]:
    run = result["run"]
    ok = run["steps"] == list(range(1, result["steps"] + 1)) and run["generators_exited"] == result["generators"]
    return {"slurm_run_s": run["wall_s"], "steps": result["steps"], "generators": result["generators"], "ok": ok}


if __name__ == "__main__":
    sys.exit(main())
