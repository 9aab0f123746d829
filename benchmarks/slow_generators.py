"""Slow generators: what a live generator's work is worth when one sample, or one engine step, is slow (SIMULATION).

    .venv/bin/python -m benchmarks.slow_generators                   # this code and the commit before issue 30
    .venv/bin/python -m benchmarks.slow_generators --before none     # this code only
    .venv/bin/python -m benchmarks.slow_generators --quick           # two points, short runs (the smoke test's)

A lease used to be a cap on rollout length: a generator whose sample took longer than buffer.lease_timeout_s, or
whose one engine step outlasted buffer.heartbeat_timeout_s (its heartbeats came from the loop, between steps), had
its prompts re-issued, and the groups it then finished came back "unknown lease" (refused) or as duplicates. Issue
30 made liveness independent of speed (actors.liveness, buffers.leases). This benchmark measures both codes on the
same grid, each point one `tandem run` in simulation (real buffer, sockets, leases, generator and learner
processes; the engine and trainer are stand-ins of configured cost) for a fixed wall time:

  sample sweep   one sample takes f x lease_timeout_s, f in SAMPLE_FACTORS, in engine steps of STEP_S
  step sweep     one engine step takes f x heartbeat_timeout_s, f in STEP_FACTORS (a sample: max(STEP_SAMPLE_S,
                 one step))

with heartbeat_timeout_s = lease_timeout_s = TIMEOUT_S (4 s: the old loop heartbeat every 2 s, so a fast engine is
alive under both codes). Per point: learner steps per hour (steps trained / wall time of the run), samples generated
(arrived + duplicates x group size, from the buffer's last record) and the share of them discarded for liveness:
refused groups (`rejected`, e.g. unknown_lease) plus duplicates, in samples; every sample has the same token count, so
it is also the share of generated tokens. Samples dropped for staleness (η) are reported apart: they are the bound
working, not a liveness fault.

Headline (`headline`): `discarded_share_live_max` (the largest share over the grid, this code; target 0) and
`discarded_share_live_max_before` (the commit before, `--before`, run from a git worktree of it), and the fewest
learner steps per hour over the grid for each. Writes results/slow_generators.json.

Failure modes: a run whose launcher does not start, or leaves no buffer record, raises RuntimeError with its output's
tail. The before-code runs need git and the commit in this clone's history (`--before none` skips them).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save
from common.metrics import read_metrics
from common.sockets import free_port

REPO = Path(__file__).resolve().parent.parent
BEFORE = "cabc17b"  # the commit before issue 30's liveness work (its heartbeats came from the loop)
TIMEOUT_S = 4.0  # buffer.heartbeat_timeout_s and buffer.lease_timeout_s
STEP_S = 0.2  # engine step of the sample sweep
SAMPLE_FACTORS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0)  # x lease_timeout_s
STEP_FACTORS = (0.5, 1.0, 2.0, 3.0)  # x heartbeat_timeout_s
STEP_SAMPLE_S = 8.0  # a sample of the step sweep lasts at least this (2 x lease_timeout_s)
MIN_RUN_S, SAMPLES_PER_RUN = 45.0, 4.0  # each run lasts max(MIN_RUN_S, SAMPLES_PER_RUN x one sample)
GROUP_SIZE, GROUPS_PER_STEP = 4, 2
CONFIG = """# benchmarks/slow_generators: a SIMULATION run with a slow engine (keys both codes know)
[run]
simulate = true
[algo]
group_size = {group_size}
max_staleness = 2
[env]
num_prompts = 4096
[buffer]
heartbeat_timeout_s = {timeout}
lease_timeout_s = {timeout}
[generator]
prompts_in_flight = 4
sim_tokens = {tokens}
sim_token_s = {step_s}
drain_timeout_s = 2
[learner]
groups_per_step = {groups}
total_steps = 1000000
sim_sample_s = 0.005
sim_weights_mb = 1.0
"""


def grid(quick: bool) -> list[dict[str, Any]]:
    """The points: sweep, factor, engine step (s), tokens a sample, one sample (s), run length (s)."""
    points = []
    for factor in (1.0, 5.0) if quick else SAMPLE_FACTORS:
        sample_s = factor * TIMEOUT_S
        points.append({"sweep": "sample", "factor": factor, "step_s": STEP_S, "sample_s": sample_s})
    for factor in () if quick else STEP_FACTORS:
        step_s = factor * TIMEOUT_S
        points.append({"sweep": "step", "factor": factor, "step_s": step_s, "sample_s": max(STEP_SAMPLE_S, step_s)})
    for point in points:
        point["tokens"] = max(1, round(point["sample_s"] / point["step_s"]))
        point["run_s"] = (20.0 if quick else MIN_RUN_S) + SAMPLES_PER_RUN * point["sample_s"]
    return points


def run_point(tree: Path, root: Path, name: str, point: dict[str, Any]) -> dict[str, Any]:
    """One `tandem run` of `tree`'s code for point["run_s"] seconds, then SIGTERM; its figures."""
    config = root / f"{name}.toml"
    config.write_text(
        CONFIG.format(
            group_size=GROUP_SIZE,
            timeout=TIMEOUT_S,
            tokens=point["tokens"],
            step_s=point["step_s"],
            groups=GROUPS_PER_STEP,
        )
    )
    args = [sys.executable, "-m", "launch.cli", "run", str(config), "--run.root", str(root), "--run.name", name]
    args += ["--buffer.host", '"127.0.0.1"', "--buffer.port", str(free_port())]
    args += ["--learner.weights_host", '"127.0.0.1"', "--learner.weights_port", str(free_port())]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    output = root / f"{name}.out"
    started = time.monotonic()
    with output.open("w") as out:
        process = subprocess.Popen(
            args, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            process.wait(timeout=point["run_s"])
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
    wall_s = time.monotonic() - started
    run_dir = root / name
    buffer_path = run_dir / "buffer.jsonl"
    if not buffer_path.exists() or not read_metrics(buffer_path):
        tail = "\n".join(output.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{name}: no buffer record (the run did not start?):\n{tail}")
    return figures(point, read_metrics(buffer_path)[-1], read_metrics(run_dir / "metrics.jsonl"), wall_s)


def figures(point: dict[str, Any], last: dict[str, Any], records: list[dict[str, Any]], wall_s: float) -> dict:
    """The point's figures from the buffer's last record and the learner's records (see the module docstring)."""
    counts = {key: int(last.get(f"buffer/{key}", 0) or 0) for key in COUNTERS}
    duplicates = counts["duplicates"] * GROUP_SIZE
    generated = counts["arrived"] + duplicates
    discarded = counts["rejected"] + duplicates
    return {
        **point,
        "wall_s": round(wall_s, 1),
        "steps": len(records),
        "steps_per_hour": len(records) / wall_s * 3600.0,
        "samples_generated": generated,
        "samples_discarded": discarded,
        "discarded_share": discarded / generated if generated else 0.0,
        "dropped_stale_share": counts["dropped_stale"] / generated if generated else 0.0,
        **{key: counts[key] for key in COUNTERS},
    }


COUNTERS = ("arrived", "rejected", "duplicates", "dropped_stale", "trained", "leases_expired", "generators_lost")


def before_tree(rev: str) -> Path:
    """A detached git worktree of `rev` (removed by `remove_tree`)."""
    path = Path(tempfile.mkdtemp(prefix="tandem-before-"))
    subprocess.run(["git", "worktree", "add", "--detach", "--force", str(path), rev], cwd=REPO, check=True)
    return path


def remove_tree(path: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, check=False)


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The largest discarded share over the grid, for this code and the commit before (None if not measured), and
    the slowest learner over it, from a result's `points` and `points_before`."""
    points, before = result["points"], result["points_before"]
    return {
        "discarded_share_live_max": max((p["discarded_share"] for p in points), default=0.0),
        "discarded_share_live_max_before": max((p["discarded_share"] for p in before), default=None),
        "steps_per_hour_min": min((p["steps_per_hour"] for p in points), default=0.0),
        "steps_per_hour_min_before": min((p["steps_per_hour"] for p in before), default=None),
    }


def show(label: str, row: dict[str, Any]) -> None:
    print(
        f"  {label} {row['sweep']} x{row['factor']:g}: step {row['step_s']:.1f}s, sample {row['sample_s']:.1f}s -> "
        f"{row['steps']} steps in {row['wall_s']:.0f}s ({row['steps_per_hour']:.0f}/h), generated "
        f"{row['samples_generated']}, discarded {row['discarded_share']:.1%} (rejected {row['rejected']}, "
        f"duplicates {row['duplicates']}), leases expired {row['leases_expired']}, stale {row['dropped_stale_share']:.1%}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=BEFORE, help="the commit to compare with, or `none`")
    parser.add_argument("--quick", action="store_true", help="two points, short runs")
    parser.add_argument("--runs-dir", type=Path, default=None, help="where the runs go (default: a temp folder)")
    parser.add_argument("--out", default="slow_generators", help="results/<out>.json")
    args = parser.parse_args()
    root = args.runs_dir or Path(tempfile.mkdtemp(prefix="slow-generators-"))
    root.mkdir(parents=True, exist_ok=True)
    points = grid(args.quick)
    now, before = [], []
    for i, point in enumerate(points):
        now.append(run_point(REPO, root, f"now-{i}", point))
        show("now   ", now[-1])
    if args.before != "none":
        tree = before_tree(args.before)
        try:
            for i, point in enumerate(points):
                before.append(run_point(tree, root, f"before-{i}", point))
                show("before", before[-1])
        finally:
            remove_tree(tree)
    result = {
        "timeout_s": TIMEOUT_S,
        "group_size": GROUP_SIZE,
        "groups_per_step": GROUPS_PER_STEP,
        "before": args.before,
        "cpu": "SIMULATION (sleep-timed engine and trainer): the figures do not depend on the CPU",
        "points": now,
        "points_before": before,
    }
    result["headline"] = headline(result)
    print(result["headline"])
    save(args.out, result)


if __name__ == "__main__":
    main()
