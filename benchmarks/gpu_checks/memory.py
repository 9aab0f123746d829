"""C4: what a process beside vLLM takes on its GPU to hold a full-model bucket set (review finding 6: the NCCL
receiver did so in the generator's process), against the 8% vLLM leaves free at its default
gpu_memory_utilization of 0.92 (less with a higher generator.gpu_memory_utilization).

Per model (Qwen2.5-1.5B and Qwen3-4B layouts, from their configs), a child process creates its CUDA context, then
allocates `common.broadcast.allocate_buckets(plan_buckets(layout))`, the receiver's device buckets; this process
reads the device's free memory (`mem_get_info`) before the child starts, after its context and after its buckets.
Recorded, not judged (a model that does not fit is the finding): the check passes when the figures were taken.

    python -m benchmarks.gpu_checks.memory      # the child: a JSON line of bucket sizes on stdin, then "go" lines
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from benchmarks.gpu_checks.shared import BUCKET_BYTES, GIB, layout_bytes, layout_of_shape

VLLM_UTILIZATION = 0.92  # vllm/config/cache.py's default gpu_memory_utilization


def check_generator_memory(device: str, shapes: list[str]) -> dict[str, Any]:
    import torch

    from common.weights import plan_buckets

    total = torch.cuda.mem_get_info()[1]
    budget = (1 - VLLM_UTILIZATION) * total
    models = {}
    for shape in shapes:
        layout = layout_of_shape(shape)
        sizes = plan_buckets(layout, BUCKET_BYTES)[1]
        models[shape] = {"model_gib": layout_bytes(layout) / GIB, **child_footprint(sizes)}
        models[shape]["fits"] = models[shape]["total_gib"] * GIB <= budget
    return {"ok": True, "device_gib": total / GIB, "budget_gib": budget / GIB, "models": models}


def child_footprint(sizes: list[int]) -> dict[str, float]:
    """GiB the child's context and buckets take, from the device's free memory at each step."""
    import torch

    child = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.gpu_checks.memory"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        free_before = torch.cuda.mem_get_info()[0]
        step(child, json.dumps(sizes), "context")
        free_context = torch.cuda.mem_get_info()[0]
        step(child, "go", "allocated")
        free_buckets = torch.cuda.mem_get_info()[0]
        step(child, "go", "done")
    finally:
        child.stdin.close()
        child.wait()
    return {
        "context_gib": (free_before - free_context) / GIB,
        "buckets_gib": (free_context - free_buckets) / GIB,
        "bucket_bytes_gib": sum(sizes) / GIB,
        "total_gib": (free_before - free_buckets) / GIB,
    }


def step(child: subprocess.Popen, line: str, expected: str) -> None:
    """Send `line`, wait for the child's line starting with `expected` (raises on anything else)."""
    child.stdin.write(line + "\n")
    child.stdin.flush()
    answer = child.stdout.readline().strip()
    if not answer.startswith(expected):
        raise RuntimeError(f"the memory child answered {answer!r}, expected {expected!r} (exit code {child.poll()})")


def child_main() -> None:
    """The generator process stand-in: a CUDA context, then the receiver's buckets, each step on a "go"."""
    import torch

    from common.broadcast import allocate_buckets

    sizes = json.loads(sys.stdin.readline())
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    print("context", flush=True)
    sys.stdin.readline()
    buckets = allocate_buckets(sizes, "cuda")
    torch.cuda.synchronize()
    print(f"allocated {sum(b.numel() for b in buckets)}", flush=True)
    sys.stdin.readline()
    print("done", flush=True)


if __name__ == "__main__":
    child_main()
