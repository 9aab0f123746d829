"""C5 and C6: weights updates at Qwen2.5-1.5B's shape through the vLLM worker's real entry points, and the
device-to-device copy they are measured against.

The engine is stood in for by `shared.StubModelRunner` around a transformers model built from the config on the
device (tied, as Qwen2.5-1.5B is); each update is fresh random weights, and is checked bit-exact by a checksum of
every byte the receiver holds, plus, for a tied model, that the output layer equals the embedding just sent and
that the loader shipped it as `lm_head.weight` (`actors.weights.cuda.with_tied_head`).

  C5(a) host-staged: `learners.snapshot.copy_into_snapshot` (device -> host buckets) -> `actors.weights.updates.
        SharedMemoryStaging.write` (the generator's staging file) -> `actors.weights.cuda.load_staged_pinned`;
  C5(b) CUDA IPC: `common.broadcast.copy_into_buckets` into one set of device buckets, reused for every update as
        the generator does, exported once (`export_buckets`); a child process on the same GPU builds its model and
        runs `load_ipc` per update. This process's memory must stay flat (after `torch.cuda.ipc_collect()`);
  C5(c) the publish cost alone: `copy_into_snapshot` into fresh and into reused host buckets (pageable or pinned,
        whatever the publisher allocates now), and `copy_into_buckets` into device buckets; both must hold the
        same bytes. Run last, skipped with less than 90 s of budget left;
  C6    a device-to-device copy of each model's bytes: the yardstick (GB/s) the paths above are read against.

    python -m benchmarks.gpu_checks.weights_paths --ipc-child    # C5(b)'s receiver (the parent starts it)
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from functools import partial
from typing import Any, BinaryIO

from benchmarks.gpu_checks.shared import (
    BUCKET_BYTES,
    GIB,
    StubModelRunner,
    build_model,
    checksum,
    gb_per_s,
    layout_bytes,
    layout_of,
    layout_of_shape,
    median,
    named_weights,
    random_weights,
    staging_dir,
    tied_head_check,
    timed,
)

EMBEDDING = "model.embed_tokens.weight"
FLAT_GIB = 0.25  # memory may move this much across the IPC updates and stay "flat": a leak is a bucket set (3 GB)


# ---------------------------------------------------------------------------------------------------- C5(a)
def check_staged_load(device: str, shape: str, updates: int = 3) -> dict[str, Any]:
    from actors.weights.updates import SharedMemoryStaging

    receiver = build_model(shape, device, seed=1)
    runner = StubModelRunner(receiver)
    layout = layout_of(named_weights(receiver))
    nbytes = layout_bytes(layout)
    directory = staging_dir(nbytes)
    staging = SharedMemoryStaging(directory)
    rows: list[dict[str, Any]] = []
    try:
        for version in range(updates):
            rows.append(staged_update(staging, runner, layout, version, rows[-1]["buckets"] if rows else None))
    finally:
        staging.close()
    for row in rows:
        del row["buckets"]
    load_s = median([row["load_s"] for row in rows])
    return {
        "ok": all(row["delivered"] for row in rows),
        "bytes": nbytes,
        "staging_dir": str(directory),
        "path": rows[-1]["path"],
        "snapshot_s": median([row["snapshot_s"] for row in rows]),
        "staging_s": median([row["staging_s"] for row in rows]),
        "load_s": load_s,
        "load_gb_s": gb_per_s(nbytes, load_s),
        "update_s": median([row["snapshot_s"] + row["staging_s"] + row["load_s"] for row in rows]),
        "updates": rows,
    }


def staged_update(staging: Any, runner: StubModelRunner, layout: list, version: int, buckets: Any) -> dict[str, Any]:
    """One host-staged update of fresh weights: snapshot (into `buckets` when given), staging file, load."""
    from actors.weights.cuda import load_staged_pinned
    from actors.weights.updates import WeightsUpdate
    from learners.snapshot import copy_into_snapshot

    device = str(runner.device)
    weights = random_weights(layout, device, seed=100 + version)
    snapshot_s, snapshot = timed(
        partial(copy_into_snapshot, version, layout, iter(weights), BUCKET_BYTES, buckets), device
    )
    update = WeightsUpdate(snapshot.header, [host_view(bucket) for bucket in snapshot.buckets], time.monotonic())
    staging_s, tensors = timed(partial(staging.write, update), device)
    load_s, report = timed(partial(load_staged_pinned, runner, str(staging.path), tensors), device)
    received = delivered(runner, weights)
    return {
        "version": version,
        "snapshot_s": snapshot_s,
        "staging_s": staging_s,
        "load_s": load_s,
        "path": report["path"],
        "report": report,
        **received,
        "buckets": snapshot.buckets,
    }


def delivered(runner: StubModelRunner, weights: list[tuple[str, Any]]) -> dict[str, bool]:
    """Whether the receiver holds exactly `weights` (and, tied, the new embedding as its output layer)."""
    figures = {"equal": checksum(named_weights(runner.model)) == checksum(weights)}
    if runner.model.config.tie_word_embeddings:
        figures.update(tied_head_check(runner.model, dict(weights)[EMBEDDING], runner.names))
    figures["delivered"] = all(figures.values())
    return figures


def host_view(bucket: Any) -> memoryview:
    """A byte view of a host bucket: a numpy array, or a CPU tensor (pinned buckets)."""
    if hasattr(bucket, "numpy"):
        bucket = bucket.numpy()
    return memoryview(bucket).cast("B")


# ---------------------------------------------------------------------------------------------------- C5(b)
def check_ipc_load(device: str, shape: str, updates: int = 5) -> dict[str, Any]:
    import torch

    from actors.weights.cuda import export_buckets
    from common.broadcast import allocate_buckets
    from common.weights import plan_buckets

    layout = layout_of_shape(shape)
    specs, sizes = plan_buckets(layout, BUCKET_BYTES)
    buckets = allocate_buckets(sizes, device)
    table = [[s.name, s.dtype, list(s.shape), s.bucket, s.offset, s.nbytes] for s in specs]
    child = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.gpu_checks.weights_paths", "--ipc-child"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        send(child.stdin, {"shape": shape, "handles": export_buckets(buckets), "tensors": table})
        receive(child.stdout)  # its model is built
        rows = [ipc_update(child, specs, layout, buckets, version) for version in range(updates)]
        send(child.stdin, {"stop": True})
    finally:
        child.stdin.close()
        child.wait()
    torch.cuda.ipc_collect()
    allocated = [row["allocated_gib"] for row in rows]
    device_free = [row["device_free_gib"] for row in rows]
    flat = max(allocated) - min(allocated) < FLAT_GIB and max(device_free) - min(device_free) < FLAT_GIB
    load_s = median([row["load"]["load_s"] + row["load"]["map_s"] for row in rows])
    return {
        "ok": flat and all(row["delivered"] for row in rows),
        "bytes": layout_bytes(layout),
        "producer_memory_flat": flat,
        "pack_s": median([row["pack_s"] for row in rows]),
        "load_s": load_s,
        "load_gb_s": gb_per_s(layout_bytes(layout), load_s),
        "update_s": median([row["pack_s"] + row["round_trip_s"] for row in rows]),
        "after_child_exit_allocated_gib": torch.cuda.memory_allocated() / GIB,
        "updates": rows,
    }


def ipc_update(child: subprocess.Popen, specs: list, layout: list, buckets: list, version: int) -> dict[str, Any]:
    """Fresh weights packed into the shared buckets, the child told to load them; its checksums compared."""
    import torch

    from common.broadcast import copy_into_buckets

    weights = random_weights(layout, "cuda", seed=200 + version)
    expected = checksum(weights)
    embedding = checksum([(EMBEDDING, dict(weights)[EMBEDDING])])
    pack_s = timed(partial(copy_into_buckets, specs, iter(weights), buckets), "cuda")[0]
    del weights
    started = time.perf_counter()
    send(child.stdin, {"version": version})
    answer = receive(child.stdout)
    round_trip_s = time.perf_counter() - started
    torch.cuda.ipc_collect()
    figures = {
        "equal": answer["checksum"] == expected,
        "head_equals_embedding": answer["head_checksum"] == embedding,
        "head_shipped": answer["head_shipped"],
    }
    return {
        "version": version,
        "pack_s": pack_s,
        "round_trip_s": round_trip_s,
        "load": answer["load"],
        **figures,
        "delivered": all(figures.values()),
        "allocated_gib": torch.cuda.memory_allocated() / GIB,
        "reserved_gib": torch.cuda.memory_reserved() / GIB,
        "device_free_gib": torch.cuda.mem_get_info()[0] / GIB,
    }


def ipc_child() -> None:
    """C5(b)'s receiver: builds its model, then per message loads the parent's buckets by `load_ipc` and answers
    with checksums. Messages travel on stdin / the original stdout; anything printed goes to stderr."""
    from actors.weights.cuda import load_ipc

    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    setup = receive(sys.stdin.buffer)
    model = build_model(setup["shape"], "cuda", seed=5)
    runner = StubModelRunner(model)
    send(replies, {"ready": True})
    while "version" in receive(sys.stdin.buffer):
        report = load_ipc(runner, setup["handles"], setup["tensors"])
        send(
            replies,
            {
                "load": report,
                "checksum": checksum(named_weights(model)),
                "head_checksum": checksum([(EMBEDDING, model.get_output_embeddings().weight)]),
                "head_shipped": "lm_head.weight" in runner.names,
            },
        )


def send(stream: BinaryIO, message: dict[str, Any]) -> None:
    import msgpack

    data = msgpack.packb(message)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def receive(stream: BinaryIO) -> dict[str, Any]:
    import msgpack

    header = stream.read(8)
    if len(header) < 8:
        raise EOFError("the IPC child closed its pipe (its stderr, in this check's log, says why)")
    return msgpack.unpackb(stream.read(struct.unpack("<Q", header)[0]))


# ---------------------------------------------------------------------------------------------------- C5(c)
def check_publish_cost(device: str, shape: str, repeats: int = 2) -> dict[str, Any]:
    import torch

    from common.broadcast import allocate_buckets, copy_into_buckets
    from common.weights import plan_buckets
    from learners.snapshot import copy_into_snapshot

    layout = layout_of_shape(shape)
    nbytes = layout_bytes(layout)
    weights = random_weights(layout, device, seed=300)
    specs, sizes = plan_buckets(layout, BUCKET_BYTES)
    snapshot = partial(copy_into_snapshot, 0, layout, bucket_bytes=BUCKET_BYTES)
    fresh_s, fresh = timed(partial(snapshot, weights=iter(weights)), device)
    reused = [timed(partial(snapshot, weights=iter(weights), buckets=fresh.buckets), device)[0] for _ in range(repeats)]
    device_buckets = allocate_buckets(sizes, device)
    to_device = [
        timed(partial(copy_into_buckets, specs, iter(weights), device_buckets), device)[0] for _ in range(repeats)
    ]
    host = [torch.frombuffer(host_view(bucket), dtype=torch.uint8) for bucket in fresh.buckets]
    equal = all(torch.equal(h.to(device), d) for h, d in zip(host, device_buckets, strict=True))
    pinned = device.startswith("cuda") and all(h.is_pinned() for h in host)
    return {
        "ok": equal,
        "bytes": nbytes,
        "same_bytes": equal,
        "host_buckets_pinned": pinned,
        "snapshot_fresh_s": fresh_s,
        "snapshot_reused_s": median(reused),
        "device_buckets_s": median(to_device),
        "snapshot_fresh_gb_s": gb_per_s(nbytes, fresh_s),
        "snapshot_reused_gb_s": gb_per_s(nbytes, median(reused)),
        "device_buckets_gb_s": gb_per_s(nbytes, median(to_device)),
    }


# ---------------------------------------------------------------------------------------------------- C6
def check_d2d_copy(device: str, shapes: list[str], repeats: int = 5) -> dict[str, Any]:
    """A copy of each model's bytes from one device buffer to another (the median after one warm-up)."""
    import torch

    models = {}
    for shape in shapes:
        nbytes = layout_bytes(layout_of_shape(shape))
        source = torch.empty(nbytes, dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
        seconds = median([timed(partial(target.copy_, source), device)[0] for _ in range(repeats + 1)][1:])
        models[shape] = {"bytes": nbytes, "d2d_s": seconds, "d2d_gb_s": gb_per_s(nbytes, seconds)}
        del source, target
    return {"ok": True, "models": models}


if __name__ == "__main__":
    if sys.argv[1:] == ["--ipc-child"]:
        ipc_child()
