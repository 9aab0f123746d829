"""Every benchmark of benchmarks/, one after another, then one summary: results/summary.json and a table.

    .venv/bin/python -m benchmarks.run_all                 # `make bench`: each with --quick where it has one
    .venv/bin/python -m benchmarks.run_all --full          # no --quick (hours on 2 cores)
    .venv/bin/python -m benchmarks.run_all --only wire_codec fleet_scaling

Each benchmark runs as `python -m benchmarks.<name> [--quick]` in its own process group (its output streams
through), with `--quick` when its `--help` lists it. A benchmark that exits non-zero, runs past `--timeout-s` (its
whole process group is killed) or leaves no results/<name>.json newer than its start is reported as failed, and the
next one runs. summary.json holds, per benchmark: status, seconds, command, headline figures (its `headline`, or
else its top-level numbers) and its whole JSON. Exit code: 0 when every benchmark that exists succeeded, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, save

BENCHMARKS = (
    "wire_codec",
    "buffer_throughput",
    "generator_throughput",
    "weight_sync",
    "learner_throughput",
    "learner_lora",
    "learner_packing",
    "async_vs_sync",
    "fleet_scaling",
    "staleness_effect",
    "length_bias",
    "time_to_reward",
    "time_to_accuracy",
    "curriculum_effect",
    "distillation",
    "demo_runs",
    "ray_overhead",
    "env_latency",
    "eval_overhead",
    "slow_generators",
    "demo_wall",
    "broadcast_rounds",
    "architectures",
    "house_counts",
    "slurm_run",
)
OPTIONAL = frozenset({"ray_overhead", "env_latency"})  # run when present
HERE = Path(__file__).resolve().parent


def has_quick(name: str) -> bool:
    """Whether `benchmarks.<name> --help` offers --quick."""
    help_text = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--help"],
        cwd=HERE.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    ).stdout
    return "--quick" in help_text


def run_benchmark(name: str, quick: bool, timeout_s: float) -> dict[str, Any]:
    """Run one benchmark (output streams through); its status, seconds, command and results."""
    argv = [sys.executable, "-m", f"benchmarks.{name}", *(["--quick"] if quick and has_quick(name) else [])]
    print(f"\n=== {name}: {' '.join(argv[1:])}", flush=True)
    started = time.time()
    process = subprocess.Popen(argv, cwd=HERE.parent, start_new_session=True)
    try:
        code: int | None = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    seconds = time.time() - started
    path = RESULTS / f"{name}.json"
    fresh = path.exists() and path.stat().st_mtime >= started
    result = json.loads(path.read_text()) if fresh else None
    if code is None:
        status = f"timed out after {timeout_s:.0f} s"
    elif code != 0:
        status = f"failed (exit {code})"
    else:
        status = "ok" if fresh else f"no fresh {path.name}"
    return {
        "name": name,
        "status": status,
        "seconds": seconds,
        "command": argv[1:],
        "headline": headline(result) if result else {},
        "result": result,
    }


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's own `headline`, else its top-level numbers and tables of numbers (ratios, targets)."""
    if isinstance(result.get("headline"), dict):
        return result["headline"]
    return {
        key: value
        for key, value in result.items()
        if _is_number(value) or (isinstance(value, dict) and value and all(map(_is_number, value.values())))
    }


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_figures(figures: dict[str, Any], limit: int = 110) -> str:
    """`key value` pairs on one line (nested dicts flattened, floats to 3 significant digits), cut at `limit`."""
    parts = []
    for key, value in figures.items():
        if isinstance(value, dict):
            parts.append(format_figures({f"{key}.{k}": v for k, v in value.items()}, limit=10**6))
        elif isinstance(value, float):
            parts.append(f"{key} {value:.3g}")
        else:
            parts.append(f"{key} {value}")
    text = "  ".join(parts)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def print_table(rows: list[dict[str, Any]]) -> None:
    width = max(len(row["name"]) for row in rows)
    print(f"\n{'benchmark':<{width}}  {'status':<22}  {'seconds':>7}  headline")
    for row in rows:
        print(f"{row['name']:<{width}}  {row['status']:<22}  {row['seconds']:7.0f}  {format_figures(row['headline'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="run without --quick")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=None, help="run only these")
    parser.add_argument("--skip", nargs="+", choices=BENCHMARKS, default=[], help="leave these out")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="longest run of one benchmark")
    args = parser.parse_args(argv)
    names = [name for name in (args.only or BENCHMARKS) if name not in args.skip]
    missing = [name for name in names if not (HERE / f"{name}.py").is_file()]
    required_missing = [name for name in missing if name not in OPTIONAL]
    if required_missing:
        print(f"missing benchmark modules (expected in {HERE}): {', '.join(required_missing)}", file=sys.stderr)
    rows = [run_benchmark(name, quick=not args.full, timeout_s=args.timeout_s) for name in names if name not in missing]
    rows += [
        {
            "name": name,
            "status": "absent (optional)" if name in OPTIONAL else "missing",
            "seconds": 0.0,
            "command": [],
            "headline": {},
            "result": None,
        }
        for name in missing
    ]
    print_table(rows)
    save("summary", {"quick": not args.full, "benchmarks": rows})
    failed = [row["name"] for row in rows if row["status"] not in ("ok", "absent (optional)")]
    if failed:
        print(f"not ok: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
