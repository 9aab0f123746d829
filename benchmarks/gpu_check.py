r"""The GPU path on one lent GPU: DeepSpeed on CUDA, host-staged and CUDA IPC updates, the CUDA-side load. <= 8 min.

What it checks (each check reports ok or its error; the others still run):
  1. the learner on CUDA DeepSpeed (learners/engine.TrainEngine, a small Llama, bf16, ZeRO-1): 3 steps, finite
     losses, weights that moved; then a real update from its CUDA weights into a CUDA receiver, host-staged:
     learners.publisher.copy_into_snapshot (device -> host buckets), actors.weights.SharedMemoryStaging (the
     generator's staging file), actors.cuda_weights.staged_to_device (the file registered as pinned memory, one
     non-blocking copy per tensor) into a transformers model standing in for the engine: equal to the learner's;
  2. a Llama-shaped model of ~1.1B parameters with random weights, built on the device from a config (nothing to
     download or carry): a device-to-device copy of its bytes (the yardstick), then the host-staged update above
     at that size, then the same update by CUDA IPC between two processes on the one GPU
     (common.broadcast.copy_into_buckets into device buckets, actors.cuda_weights.export_buckets, a child process
     that opens them with ipc_tensors and loads its own model from them, no host round trip), each checked
     bit-exact by a checksum of every byte.
It prints seconds per update and GB/s against the device-to-device copy, and saves benchmarks/results/gpu_check.json
(`benchmarks.common.save`, with a headline; also copied to --out). Without CUDA it says so and exits 0, writing
nothing. NCCL broadcast and CUDA vLLM are not checked: that machine has no vLLM (its CUDA wheel does not fit in
what can be carried), and vLLM's PyNcclCommunicator is the NCCL group.

The lent machine has CUDA torch, transformers, numpy and msgpack, but not pyzmq, pydantic or deepspeed (imported by
the modules checked), and reaches no registry: carry them (22 MB of the 64 MiB allowed), copied from this checkout's
.venv (their binaries are CPython 3.11's: the command below prints the lent machine's version first; for another
one, `pip download` the same versions for it instead). Here, once:

    mkdir -p gpu_site && (cd .venv/lib/python3.11/site-packages && cp -r deepspeed deepspeed-0.19.8.dist-info \
        zmq pyzmq.libs pyzmq-27.3.0.dist-info pydantic pydantic-2.14.4.dist-info pydantic_core \
        pydantic_core-2.50.5.dist-info annotated_types typing_inspection hjson cpuinfo einops ../../../../gpu_site/)
    find gpu_site -name __pycache__ -prune -exec rm -rf {} +
    echo gpu_site/ >> .git/info/exclude                   # `run` carries ignored paths only

then on the device (the `run` tool, carry=["gpu_site"], timeout_s=540):

    python -V && PYTHONPATH=gpu_site python -m benchmarks.gpu_check --out $OUT

Checked here: with only that folder standing in for what the lent machine lacks (python -S, vLLM, deepspeed,
pyzmq and pydantic hidden), check 1 ran on CPU (DEVICE = "cpu"): 3 DeepSpeed steps, the update received bit-exact.

    python -m benchmarks.gpu_check --help
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

LARGE = {  # TinyLlama-1.1B's shape: 1.10e9 parameters, 2.2 GB in bfloat16
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
}
SMALL = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
BUCKET_BYTES = 128 << 20  # common.weights.DEFAULT_BUCKET_MB
DEVICE = "cuda"  # where models are built (tests/benchmarks/test_gpu_check.py runs the plumbing with "cpu")


# ---------------------------------------------------------------------------------------------------- models
def llama(shape: dict[str, int], seed: int) -> Any:
    """A Llama-shaped causal LM with random bfloat16 weights, built on the GPU (no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape, max_position_embeddings=512, tie_word_embeddings=False)
    with torch.device(DEVICE):
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def named_weights(model: Any) -> list[tuple[str, Any]]:
    return [(name, param.detach()) for name, param in model.named_parameters()]


def layout_of(weights: list[tuple[str, Any]]) -> list[tuple[str, str, list[int]]]:
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in weights]


def load_into(model: Any, weights: Iterable[tuple[str, Any]]) -> int:
    """The engine's load, stood in for by a transformers model: copy each tensor into the parameter of its name
    (on the current stream: a tensor still being copied in is ordered before it). Returns the bytes loaded."""
    params, loaded = dict(model.named_parameters()), 0
    for name, tensor in weights:
        params[name].data.copy_(tensor)
        loaded += tensor.numel() * tensor.element_size()
    return loaded


def checksum(weights: Iterable[tuple[str, Any]]) -> int:
    """Every byte of every tensor, summed with its position mixed in (a changed or moved byte changes it)."""
    import torch

    total = torch.zeros((), dtype=torch.int64, device=DEVICE)
    for index, (_, tensor) in enumerate(weights):
        words = tensor.contiguous().view(-1).view(torch.uint8).to(torch.int64)
        total += (words * (index + 1)).sum() + words[::7919].sum() * 31
    return int(total)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(wall seconds, result) of `fn`, the GPU's queued work before and after it included (synchronised)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    value = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, value


# ---------------------------------------------------------------------------------------------------- checks
def check_deepspeed_learner() -> dict[str, Any]:
    """Check 1: DeepSpeed on CUDA trains a small model; its weights reach a receiver host-staged, bit-exact."""
    import torch

    from learners import engine as eng

    dist = eng.init_distributed()
    policy_module = llama(SMALL, seed=1).train()
    settings = eng.EngineSettings(lr=1e-3, zero_stage=1, bf16=True, micro_batch_size=2, micro_steps=1)
    policy = eng.TrainEngine(policy_module, settings)
    before = checksum(policy.full_weights())
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, SMALL["vocab_size"], (2, 64), device=eng.device())
        loss = policy(input_ids=tokens, labels=tokens).loss
        policy.backward(loss)
        policy.step()
        losses.append(float(loss.detach()))
    weights = list(policy.full_weights())
    receiver = llama(SMALL, seed=2)
    update = host_staged_update(weights, receiver, repeats=1)
    return {
        "device": str(eng.device()),
        "world_size": dist.world_size,
        "losses": losses,
        "finite": all(math.isfinite(loss) for loss in losses),
        "weights_moved": checksum(weights) != before,
        "received_equal": checksum(named_weights(receiver)) == checksum(weights),
        "update_s": update["update_s"],
        "pinned": update["pinned"],
    }


def host_staged_update(weights: list[tuple[str, Any]], receiver: Any, repeats: int) -> dict[str, Any]:
    """The CPU-transport update into a CUDA receiver: snapshot (device -> host buckets), staging file, pinned load.
    Median seconds of each stage over `repeats`."""
    from actors.cuda_weights import PinnedFile, staged_to_device
    from actors.weights import SharedMemoryStaging, WeightsUpdate
    from learners.publisher import copy_into_snapshot

    layout, nbytes = layout_of(weights), sum(t.numel() * t.element_size() for _, t in weights)
    staging = SharedMemoryStaging(staging_dir(nbytes))
    stages: dict[str, list[float]] = {"snapshot_s": [], "staging_s": [], "pinned_load_s": []}
    buckets = None
    try:
        for _ in range(repeats):
            took, snapshot = timed(partial(copy_into_snapshot, 0, layout, iter(weights), BUCKET_BYTES, buckets))
            stages["snapshot_s"].append(took)
            buckets = snapshot.buckets
            update = WeightsUpdate(snapshot.header, [memoryview(b) for b in buckets], time.monotonic())
            took, tensors = timed(partial(staging.write, update))
            stages["staging_s"].append(took)
            staged = staged_to_device(str(staging.path), tensors, receiver.device)
            stages["pinned_load_s"].append(timed(partial(load_into, receiver, staged))[0])
        with PinnedFile(str(staging.path), receiver.device) as probe:
            pinned = probe.pinned
    finally:
        staging.close()
    medians = {key: statistics.median(values) for key, values in stages.items()}
    return {**medians, "update_s": sum(medians.values()), "pinned": pinned, "bytes": nbytes}


def staging_dir(nbytes: int) -> Path:
    """/dev/shm when it has room for the staging file (containers often give it 64 MB), else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 1.5 * nbytes:
        return shm
    return Path(tempfile.gettempdir())


def check_large(repeats: int) -> dict[str, Any]:
    """Check 2: at ~1.1B parameters, a device-to-device copy, the host-staged update, and the CUDA IPC update."""
    import torch

    built = time.perf_counter()
    learner = llama(LARGE, seed=3)
    weights = named_weights(learner)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    result: dict[str, Any] = {
        "parameters": sum(t.numel() for _, t in weights),
        "bytes": nbytes,
        "build_s": time.perf_counter() - built,
        "gpu": torch.cuda.get_device_name(),
    }
    source = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    target = torch.empty_like(source)
    result["d2d_copy_s"] = statistics.median(timed(partial(target.copy_, source))[0] for _ in range(max(3, repeats)))
    source = target = None  # 2 x 2.2 GB back to the allocator
    expected = checksum(weights)
    receiver = llama(LARGE, seed=4)
    result["host_staged"] = host_staged_update(weights, receiver, repeats)
    result["host_staged"]["received_equal"] = checksum(named_weights(receiver)) == expected
    del receiver
    torch.cuda.empty_cache()
    result["ipc"] = ipc_update(weights, expected, repeats)
    return result


def ipc_update(weights: list[tuple[str, Any]], expected: int, repeats: int) -> dict[str, Any]:
    """Pack into device buckets (what the broadcast publisher sends), export them by CUDA IPC, and let a child
    process on the same GPU load its own model from them; the child's checksum must be the learner's."""
    import msgpack

    from actors.cuda_weights import export_buckets
    from common.broadcast import allocate_buckets, copy_into_buckets
    from common.weights import plan_buckets

    specs, sizes = plan_buckets(layout_of(weights), BUCKET_BYTES)
    buckets = allocate_buckets(sizes, DEVICE)
    pack_s = statistics.median(
        timed(partial(copy_into_buckets, specs, iter(weights), buckets))[0] for _ in range(repeats)
    )
    table = [(s.name, s.dtype, list(s.shape), s.bucket, s.offset, s.nbytes) for s in specs]
    message = msgpack.packb({"handles": export_buckets(buckets), "tensors": table, "repeats": repeats})
    child = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--ipc-child"],
        input=message,
        capture_output=True,
        timeout=240,
        check=False,
    )
    if child.returncode != 0:
        raise RuntimeError(f"IPC child exited {child.returncode}: {child.stderr.decode()[-2000:]}")
    report = json.loads(child.stdout.decode().strip().splitlines()[-1])
    del buckets  # only now: the child has finished with them
    return {
        "pack_s": pack_s,
        **report,
        "update_s": pack_s + report["ipc_load_s"],
        "received_equal": report["checksum"] == expected,
    }


def ipc_child() -> None:
    """The receiving process of `ipc_update`: its own model on the same GPU, loaded from the parent's buckets."""
    import msgpack
    import torch

    from actors.cuda_weights import ipc_tensors

    message = msgpack.unpackb(sys.stdin.buffer.read())
    receiver = llama(LARGE, seed=5)
    tensors = [tuple(row) for row in message["tensors"]]
    opened = time.perf_counter()
    views = list(ipc_tensors(message["handles"], tensors))
    open_s = time.perf_counter() - opened
    times = [timed(partial(load_into, receiver, views))[0] for _ in range(message["repeats"])]
    torch.cuda.synchronize()
    report = {"ipc_open_s": open_s, "ipc_load_s": statistics.median(times)}
    report["checksum"] = checksum(named_weights(receiver))
    print(json.dumps(report))


# ---------------------------------------------------------------------------------------------------- report
def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The figures issues quote: seconds per update and GB/s of each path at ~1.1B parameters, over the
    device-to-device copy, and whether every check passed."""
    large = result.get("large") or {}
    row: dict[str, Any] = {"all_ok": all(check["ok"] for check in result["checks"].values())}
    if "d2d_copy_s" in large:
        row["bytes"] = large["bytes"]
        row["d2d_gb_s"] = large["bytes"] / large["d2d_copy_s"] / 1e9
        for path in ("host_staged", "ipc"):
            if path in large:
                row[f"{path}_update_s"] = large[path]["update_s"]
                row[f"{path}_gb_s"] = large["bytes"] / large[path]["update_s"] / 1e9
                row[f"{path}_over_d2d"] = large[path]["update_s"] / large["d2d_copy_s"]
    return row


def run_check(name: str, fn: Callable[[], dict[str, Any]], checks: dict[str, Any]) -> dict[str, Any] | None:
    started = time.perf_counter()
    try:
        figures = fn()
    except Exception as error:  # noqa: BLE001 - one failed check is reported and the others still run
        checks[name] = {"ok": False, "error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
        print(f"[{name}] FAILED after {time.perf_counter() - started:.1f}s\n{traceback.format_exc()}", flush=True)
        return None
    equal = all(v for k, v in _flat(figures) if k in ("received_equal", "finite", "weights_moved"))
    checks[name] = {"ok": equal, "seconds": time.perf_counter() - started}
    print(f"[{name}] {'ok' if equal else 'MISMATCH'} in {time.perf_counter() - started:.1f}s", flush=True)
    return figures


def _flat(figures: dict[str, Any]) -> list[tuple[str, Any]]:
    rows = []
    for key, value in figures.items():
        rows.extend(_flat(value) if isinstance(value, dict) else [(key, value)])
    return rows


def print_figures(large: dict[str, Any]) -> None:
    nbytes, d2d = large["bytes"], large["d2d_copy_s"]
    print(f"{large['parameters'] / 1e9:.2f}B parameters, {nbytes / 1e9:.2f} GB bf16 on {large['gpu']}")
    print(f"  device-to-device copy  {d2d:.4f} s  {nbytes / d2d / 1e9:7.1f} GB/s")
    for path in ("host_staged", "ipc"):
        if path in large:
            row = large[path]
            stages = " ".join(f"{k}={v:.4f}" for k, v in row.items() if k.endswith("_s") and k != "update_s")
            print(
                f"  {path:<12} update {row['update_s']:.4f} s  {nbytes / row['update_s'] / 1e9:7.1f} GB/s  "
                f"{row['update_s'] / d2d:5.1f}x d2d  equal={row['received_equal']}  ({stages})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="updates per path (the median is reported)")
    parser.add_argument("--out", type=Path, default=None, help="also copy the results JSON here (the run tool's $OUT)")
    parser.add_argument("--ipc-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ipc_child:
        ipc_child()
        return
    import torch

    if not torch.cuda.is_available():
        print("benchmarks.gpu_check needs a CUDA GPU and this machine has none: nothing checked, nothing written")
        return
    checks: dict[str, Any] = {}
    learner = run_check("deepspeed_learner", check_deepspeed_learner, checks)
    large = run_check("large_model_updates", lambda: check_large(args.repeats), checks)
    result = {"checks": checks, "learner": learner, "large": large, "torch": torch.__version__}
    if large is not None:
        print_figures(large)
    from benchmarks.common import save

    path = save("gpu_check", {"headline": headline(result), **result})
    print(json.dumps(headline(result), indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, args.out / path.name)
    sys.exit(0 if all(check["ok"] for check in checks.values()) else 1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
