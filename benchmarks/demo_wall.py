"""The demo's wall time on this machine, and what it learned: `tandem demo` from start to exit (issue 30).

    .venv/bin/python -m benchmarks.demo_wall                       # results/demo_wall.json (demo_wall_avx2.json
                                                                   # on a CPU without AVX-512)
    .venv/bin/python -m benchmarks.demo_wall --emulate-avx2        # results/demo_wall_avx2_emulated.json

Runs the embedded default (`tandem demo`: SmolLM2-135M-Instruct, arithmetic, async GRPO, η = 2; its config is
launch/configs/demo.toml) as a user would, in a run root of its own, and times it from launch to exit. Then reads
what the run wrote: the learner's steps and reward (metrics.jsonl: the mean of the first and last 20% of steps),
the held-out strict accuracy of the greedy completions at the first and last version evaluated (eval.jsonl, set
`arithmetic`: prompts never trained on), and which dtype the roles chose (`model.dtype = "auto"`, from the learner's
log line). The CPU's flags that decide the dtype and the speed are saved beside them.

Headline keys: `wall_s`, `cpu_flags` (avx2, avx512f, avx512_bf16, amx_bf16 as booleans), `dtype`,
`heldout_strict_first`, `heldout_strict_last` (target: wall_s <= 900 on every CPU of this kind, and a rise).

`--emulate-avx2` runs the same demo with torch, oneDNN and MKL held to AVX2 kernels (ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2) and float32, as an AVX2-only CPU would run it: an estimate
only (vLLM's CPU kernels keep this CPU's ISA, and a real AVX2-only CPU runs at its own clock and width; the factor
between the two is measured by `--gemm`, a model-shaped one-thread GEMM, and saved).

Failure modes: a demo that exits non-zero or outlives `--timeout-s` raises RuntimeError with its output's tail.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save
from common.dtypes import read_cpu_flags
from common.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
HELD_OUT = "arithmetic"  # the eval set of held-out prompts (common.eval_sets)
ZEN1_GEMM_GFLOPS = 31.3  # the AVX2-only AMD EPYC's model-shaped one-thread float32 GEMM (docs/DESIGN.md)


def cpu_flags() -> dict[str, bool]:
    flags = read_cpu_flags()
    return {flag: flag in flags for flag in FLAGS}


def gemm_gflops(env: dict[str, str]) -> float:
    """A model-shaped float32 GEMM (2700x576 @ 576x1536, SmolLM2's MLP), one thread, in a fresh process with `env`."""
    code = (
        "import time, torch\ntorch.set_num_threads(1)\n"
        "a, b = torch.randn(2700, 576), torch.randn(576, 1536)\n"
        "for _ in range(3): a @ b\n"
        "t = time.perf_counter()\nfor _ in range(20): a @ b\n"
        "print(2 * 2700 * 576 * 1536 * 20 / (time.perf_counter() - t) / 1e9)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def run_demo(root: Path, env: dict[str, str], overrides: list[str], timeout_s: float) -> tuple[float, Path, str]:
    """`tandem demo` under `root`; (wall seconds, run dir, output)."""
    args = [sys.executable, "-m", "launch.cli", "demo", "--run.root", str(root), *overrides]
    started = time.monotonic()
    out = subprocess.run(
        args, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    wall_s = time.monotonic() - started
    output = out.stdout + out.stderr
    if out.returncode != 0:
        raise RuntimeError(f"tandem demo exited {out.returncode}:\n{output[-4000:]}")
    return wall_s, root / "demo", output


def heldout(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The first and last version's held-out greedy strict accuracy: ({version, value}, {version, value})."""
    key = f"eval/{HELD_OUT}/greedy/strict_accuracy"
    points = sorted((int(row["step"]), float(row[key])) for row in rows if key in row)
    if not points:
        raise RuntimeError(f"eval.jsonl has no {key}: did the demo evaluate?")
    (v0, first), (v1, last) = points[0], points[-1]
    return {"version": v0, "value": first}, {"version": v1, "value": last}


def chosen_dtype(run_dir: Path) -> str:
    """The learner's dtype as it logged it (`model.dtype auto -> float32: ...`, common.dtypes)."""
    text = (run_dir / "logs" / "learner-0.log").read_text(errors="replace")
    found = re.search(r"model\.dtype (?:auto -> )?(\w+)", text)
    return found.group(1) if found else "unknown"


def figures(wall_s: float, run_dir: Path) -> dict[str, Any]:
    records = read_metrics(run_dir / "metrics.jsonl")
    rewards = [float(r["reward/mean"]) for r in records if "reward/mean" in r]
    fifth = max(1, len(rewards) // 5)
    first, last = heldout(read_metrics(run_dir / "eval.jsonl"))
    return {
        "wall_s": round(wall_s, 1),
        "steps": len(records),
        "first_step_s": records[0].get("time") if records else None,
        "reward_first_20pct": sum(rewards[:fifth]) / fifth if rewards else None,
        "reward_last_20pct": sum(rewards[-fifth:]) / fifth if rewards else None,
        "dtype": chosen_dtype(run_dir),
        "heldout_strict_first": first["value"],
        "heldout_strict_first_version": first["version"],
        "heldout_strict_last": last["value"],
        "heldout_strict_last_version": last["version"],
    }


HEADLINE = ("wall_s", "cpu_flags", "dtype", "heldout_strict_first", "heldout_strict_last", "steps")


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's keys, from a saved result: wall time, CPU flags, dtype, held-out strict accuracy first and last."""
    return {key: result[key] for key in HEADLINE}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emulate-avx2", action="store_true", help="AVX2 kernels and float32 (an estimate)")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--runs-dir", type=Path, default=None, help="the run root (default: a temp folder)")
    args = parser.parse_args()
    env = AVX2_ENV if args.emulate_avx2 else {}
    overrides = ["--model.dtype", '"float32"'] if args.emulate_avx2 else []
    root = args.runs_dir or Path(tempfile.mkdtemp(prefix="demo-wall-"))
    wall_s, run_dir, output = run_demo(root, env, overrides, args.timeout_s)
    result = {
        **figures(wall_s, run_dir),
        "cpu_flags": cpu_flags(),
        "cpu_model": next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "unknown",
        ),
        "emulated_avx2": args.emulate_avx2,
        "gemm_gflops": gemm_gflops(env),
        "run_dir": str(run_dir),
        "summary": output.strip().splitlines()[-25:],
    }
    if args.emulate_avx2:  # how much faster this emulation computes than the AVX2-only EPYC of docs/DESIGN.md
        result["gemm_factor_vs_zen1"] = result["gemm_gflops"] / ZEN1_GEMM_GFLOPS
    result["headline"] = headline(result)
    print(result["headline"])
    save(result_name(args.emulate_avx2, result["cpu_flags"]), result)


def result_name(emulated: bool, flags: dict[str, bool]) -> str:
    """demo_wall_avx2_emulated for the estimate; demo_wall_avx2 on a real AVX2-only CPU, so that its figure stands
    beside the AVX-512 one (demo_wall) instead of replacing it."""
    if emulated:
        return "demo_wall_avx2_emulated"
    return "demo_wall" if flags.get("avx512f") else "demo_wall_avx2"


if __name__ == "__main__":
    main()
