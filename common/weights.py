"""Weights on the wire: a name -> array dict laid out in buckets of at most N MiB, checked and viewed without copies.

The learner's publisher and the generator's receiver both follow this layout, and nothing else:

    publisher (learner, learners/publisher.py)              receiver (generator, actors/weights/updates.py)
    specs, sizes = plan_buckets(layout, bucket_bytes)       reply, payload = client.request(WeightsRequest(...))
    # copy each tensor into bucket spec.bucket at spec.offset   views = check_frames(reply, payload)
    server.reply(request, header, payload=buckets)          # tensor = views[spec.bucket][spec.offset:...]

Layout (one update = one `WeightsHeader` + `len(bucket_sizes)` raw frames):
  * Tensors are laid out in the order given (the publisher's `named_parameters()` order), greedily: a tensor
    goes into the current bucket if it fits under `bucket_bytes`, else a new bucket starts. A tensor larger than
    `bucket_bytes` gets a bucket of its own (the socket's max message size is the hard limit, not this).
  * Inside a bucket every tensor starts at a multiple of `ALIGN` bytes (64), so views are aligned for SIMD copies;
    the gaps are zero bytes. `TensorSpec.offset` is that start, `TensorSpec.nbytes` the tensor's exact size.
  * Bytes are the tensor's C-order memory, little-endian. `TensorSpec.dtype` is the dtype *name*
    (`float32`, `float16`, `bfloat16`, `int64`, ...). bfloat16 has no numpy dtype: it travels as its raw 2-byte
    words (`storage_dtype("bfloat16")` is uint16) and the role that has torch reinterprets them
    (`torch.from_numpy(a).view(torch.bfloat16)`).
  * `bucket_sizes[i]` = bytes of frame i (the end of its last tensor; no trailing padding).
`launch.testing.pack_weights` / `unpack_weights` build and read a whole update from numpy arrays (fakes, tests).

Adapter-only updates (learner.lora.sync = "adapter"): the same layout, with the tensors the LoRA A/B matrices
only and the header's `lora_rank` > 0, `lora_alpha`, `lora_target_modules`; `check_layout` then also checks the
names and shapes (`check_adapter`). The transports carry the bytes unchanged; the generator's engine writes them
as a peft adapter directory that vLLM loads as a LoRA adapter (actors/engine/adapters.py).

Request/reply (what the generator's receiver expects of the publisher): `WeightsRequest(generator_id, have_version)`
is answered with `WeightsHeader` (transport "zmq") + the buckets as payload frames when the publisher's version is
newer than `have_version`, else with `WeightsNotNewer(latest_version)`. The publisher may instead hold a request
that has nothing newer (a long poll, with a deferred reply) and answer it the moment it publishes, or with
`WeightsNotNewer` after at most 60 s (the generator waits up to 120 s for a reply). Holding cuts the sync latency
by the generator's polling period (1 s, 0.2 s while the buffer is waiting for a newer version).

Failure modes: `plan_buckets` and `storage_dtype` raise `ValueError` for a bucket size <= 0 or a dtype name they do
not know; `check_frames` raises `WeightsLayoutError` (a ValueError) for any header the frames do not match or that
no publisher writes (see its docstring): a receiver counts it and asks again, it never indexes with it.
Imports numpy only (no torch).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from common.weight_messages import TensorSpec, WeightsHeader

log = logging.getLogger("tandem.common.weights")

ALIGN = 64
DEFAULT_BUCKET_MB = 128.0
MAX_NDIM = 8  # the model's tensors have 1 or 2 dims; more is a malformed header
MAX_POLICY_VERSION = 2**31 - 1  # versions travel as int32 in every rollout (token_versions, versions)

# dtype name -> numpy dtype that holds the same bytes (bfloat16 has no numpy dtype: uint16 words).
STORAGE_DTYPES: dict[str, np.dtype] = {
    **{
        name: np.dtype(name)
        for name in ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")
    },
    "bfloat16": np.dtype("uint16"),
}


class WeightsLayoutError(ValueError):
    """Received weight frames do not match their header (a bug or a corrupted/mixed update)."""


def storage_dtype(dtype_name: str) -> np.dtype:
    """The numpy dtype whose items have the bytes of `dtype_name` (bfloat16 -> uint16)."""
    try:
        return STORAGE_DTYPES[dtype_name]
    except KeyError:
        supported = sorted(STORAGE_DTYPES)
        raise ValueError(f"weights dtype '{dtype_name}' is not supported; use one of {supported}") from None


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(
    tensors: Sequence[tuple[str, str, Sequence[int]]], bucket_bytes: int
) -> tuple[list[TensorSpec], list[int]]:
    """Where each (name, dtype name, shape) lies: its `TensorSpec`s and the bucket sizes, by the layout above.

    Lets a publisher copy its tensors straight into preallocated buckets without building numpy arrays first.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0 (got {bucket_bytes})")
    specs: list[TensorSpec] = []
    sizes: list[int] = []
    for name, dtype_name, shape in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * storage_dtype(dtype_name).itemsize
        start = _aligned(sizes[-1]) if sizes else 0
        if not sizes or (start + nbytes > bucket_bytes and sizes[-1] > 0):
            sizes.append(0)
            start = 0
        specs.append(TensorSpec(name, dtype_name, [int(d) for d in shape], len(sizes) - 1, start, nbytes))
        sizes[-1] = start + nbytes
    return specs, sizes


def check_frames(header: WeightsHeader, buckets: Sequence[Any]) -> list[memoryview]:
    """The buckets as byte memoryviews, after checking they match the header; raises `WeightsLayoutError`.

    Checked, because the header comes from a peer: a version within [0, MAX_POLICY_VERSION]; the frame count and
    every frame's size; per tensor a non-empty unique name, a dtype of `STORAGE_DTYPES`, at most `MAX_NDIM`
    non-negative dims whose product times the item size is `nbytes`, a bucket index in range and an `ALIGN`-ed
    offset with its bytes inside that bucket; no two tensors sharing a byte; for an adapter update (`lora_rank`
    > 0) the rules of `check_adapter`.
    """
    views = [_byte_view(b) for b in buckets]
    if len(views) != len(header.bucket_sizes):
        raise WeightsLayoutError(f"header announces {len(header.bucket_sizes)} buckets, {len(views)} frames came")
    for index, (view, size) in enumerate(zip(views, header.bucket_sizes)):
        if view.nbytes != size:
            raise WeightsLayoutError(f"bucket {index}: {view.nbytes} bytes arrived, header says {size}")
    check_layout(header)
    return views


def check_layout(header: WeightsHeader) -> None:
    """`check_frames` without the frames: the version and every tensor against the header's bucket sizes (what a
    relay receiver checks before any chunk arrives); raises `WeightsLayoutError`."""
    if not 0 <= header.policy_version <= MAX_POLICY_VERSION:
        raise WeightsLayoutError(f"policy_version {header.policy_version} is outside [0, {MAX_POLICY_VERSION}]")
    names: set[str] = set()
    for spec in header.tensors:
        _check_spec(spec, header.bucket_sizes, names)
    _check_disjoint(header.tensors)
    if header.lora_rank:
        check_adapter(header)


ADAPTER_DTYPES = ("float32", "bfloat16", "float16")
MAX_ADAPTER_NAME_CHARS = 300
_ADAPTER_NAME = re.compile(
    r"((?:[A-Za-z_][A-Za-z0-9_]*|[0-9]+)(?:\.(?:[A-Za-z_][A-Za-z0-9_]*|[0-9]+))*)\.lora_([AB])\.weight"
)


def check_adapter(header: WeightsHeader) -> None:
    """An adapter-only update (`lora_rank` > 0) holds exactly the LoRA matrices of the contract, else
    `WeightsLayoutError`: every name is `<module path>.lora_A.weight` or `.lora_B.weight` (peft's names without
    "base_model.model.", e.g. "model.layers.0.self_attn.q_proj.lora_A.weight"), the path's last part one of
    `lora_target_modules`; a floating dtype of `ADAPTER_DTYPES`; A is [rank, in] and B [out, rank]; and each
    module has both. (Whether the modules exist in the model is the engine's check, when it loads the adapter.)"""
    rank, targets = header.lora_rank, set(header.lora_target_modules)
    halves: dict[str, set[str]] = {}
    for spec in header.tensors:
        label = repr(spec.name[:80])
        match = _ADAPTER_NAME.fullmatch(spec.name) if len(spec.name) <= MAX_ADAPTER_NAME_CHARS else None
        if match is None or match[1].startswith("base_model."):
            raise WeightsLayoutError(
                f"adapter tensor {label}: not a LoRA name ('<module path>.lora_A.weight' or '.lora_B.weight', "
                "without peft's 'base_model.model.' prefix)"
            )
        module, half = match[1], match[2]
        if module.rsplit(".", 1)[-1] not in targets:
            raise WeightsLayoutError(f"adapter tensor {label}: its module is none of lora_target_modules")
        if spec.dtype not in ADAPTER_DTYPES:
            raise WeightsLayoutError(f"adapter tensor {label}: dtype {spec.dtype!r} is none of {ADAPTER_DTYPES}")
        rank_dim = 0 if half == "A" else 1
        if len(spec.shape) != 2 or spec.shape[rank_dim] != rank or spec.shape[1 - rank_dim] == 0:
            expected = "[rank, in]" if half == "A" else "[out, rank]"
            raise WeightsLayoutError(f"adapter tensor {label}: shape {spec.shape} is not {expected} with rank {rank}")
        halves.setdefault(module, set()).add(half)
    unpaired = sorted(module for module, found in halves.items() if found != {"A", "B"})
    if unpaired or not halves:
        raise WeightsLayoutError(
            f"adapter update v{header.policy_version}: "
            + (f"{unpaired[0][:80]!r} lacks its lora_A or lora_B" if unpaired else "no tensors")
        )


def _check_spec(spec: TensorSpec, sizes: Sequence[int], names: set[str]) -> None:
    label = repr(spec.name[:80])
    if not spec.name or spec.name in names:
        raise WeightsLayoutError(f"tensor {label}: names must be non-empty and unique")
    names.add(spec.name)
    if spec.dtype not in STORAGE_DTYPES:
        raise WeightsLayoutError(f"tensor {label}: dtype {spec.dtype[:40]!r} is none of {sorted(STORAGE_DTYPES)}")
    if len(spec.shape) > MAX_NDIM or any(d < 0 for d in spec.shape):
        raise WeightsLayoutError(f"tensor {label}: shape must have <= {MAX_NDIM} non-negative dims")
    expected = math.prod(spec.shape) * STORAGE_DTYPES[spec.dtype].itemsize  # Python ints: no overflow
    if spec.nbytes != expected:
        raise WeightsLayoutError(f"tensor {label}: nbytes {spec.nbytes} != shape {spec.shape} x itemsize")
    if not 0 <= spec.bucket < len(sizes):
        raise WeightsLayoutError(f"tensor {label}: bucket {spec.bucket} out of range (0..{len(sizes) - 1})")
    if spec.offset < 0 or spec.offset % ALIGN or spec.offset + spec.nbytes > sizes[spec.bucket]:
        raise WeightsLayoutError(
            f"tensor {label}: offset {spec.offset} unaligned or bytes outside bucket {spec.bucket}"
        )


def _check_disjoint(tensors: Sequence[TensorSpec]) -> None:
    previous: TensorSpec | None = None
    for spec in sorted(tensors, key=lambda t: (t.bucket, t.offset)):
        if previous is not None and previous.bucket == spec.bucket and previous.offset + previous.nbytes > spec.offset:
            raise WeightsLayoutError(f"tensors {previous.name[:80]!r} and {spec.name[:80]!r} overlap")
        previous = spec


def _byte_view(frame: Any) -> memoryview:
    view = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)  # zmq.Frame or any buffer
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def total_bytes(header: WeightsHeader) -> int:
    """Bytes of all buckets of an update (what travels)."""
    return int(sum(header.bucket_sizes))


# ------------------------------------------------------------------------------------------------------ chunks
def chunk_ranges(bucket_sizes: Sequence[int], chunk_bytes: int) -> list[tuple[int, int, int]]:
    """The relay transport's chunks: (bucket, start, end) byte ranges, each bucket cut into `chunk_bytes` pieces
    in order (the last piece of a bucket may be shorter; an empty bucket has none). Chunk i of an update is the
    i-th range; both ends of a relay derive the same list from the header."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0 (got {chunk_bytes})")
    return [
        (bucket, start, min(start + chunk_bytes, size))
        for bucket, size in enumerate(bucket_sizes)
        for start in range(0, size, chunk_bytes)
    ]


def chunk_digest(data: Any) -> str:
    """The sha256 hex digest of a chunk's bytes (hashlib releases the GIL: threads digest in parallel)."""
    return hashlib.sha256(data).hexdigest()


def digest_chunks(buckets: Sequence[Any], chunk_bytes: int, threads: int = 2) -> list[str]:
    """Every chunk's digest, in chunk order (`threads` at once)."""
    views = [_byte_view(b) for b in buckets]
    ranges = chunk_ranges([v.nbytes for v in views], chunk_bytes)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(lambda r: chunk_digest(views[r[0]][r[1] : r[2]]), ranges))


# -------------------------------------------------------------------------------------------- shared memory
SHARED_MEMORY = Path("/dev/shm")
_said: set[Path] = set()  # fallback directories already announced by this process (room_for says each once)


def free_bytes(path: Path) -> int:
    """Bytes this user may still write on the file system of `path` (of its nearest existing ancestor)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    space = os.statvfs(path)
    return space.f_bavail * space.f_frsize


def no_room(directory: Path, need_bytes: int, held_bytes: int = 0) -> str | None:
    """None when the file system of `directory` has room for `need_bytes` (its free space plus `held_bytes`, what
    files there that the writes replace already hold); else what is short, in one phrase."""
    free = free_bytes(directory) + held_bytes
    return (
        None if free >= need_bytes else f"{directory} has {free >> 20} MiB free for {need_bytes >> 20} MiB of weights"
    )


def room_for(directory: Path, need_bytes: int, held_bytes: int = 0) -> Path:
    """Where `need_bytes` of weights are written through a mapping: `directory` when it has room (no_room); else,
    for a directory
    in /dev/shm, the same path under the temporary directory (disk-backed on most machines: slower loads), said
    once per process with the advice that keeps them in memory. Raises OSError when neither has room: a write
    through a mapping past a full tmpfs or disk is SIGBUS, which kills the process without a word."""
    short = no_room(directory, need_bytes, held_bytes)
    if short is None:
        return directory
    if not directory.is_relative_to(SHARED_MEMORY):
        raise OSError(f"{short}: free space there")
    fallback = Path(tempfile.gettempdir()) / directory.relative_to(SHARED_MEMORY)
    advice = (
        "give the container more shared memory to keep them in memory: docker run --shm-size="
        f"{math.ceil(need_bytes / 2**30) + 1}g (Kubernetes: an emptyDir with medium Memory mounted at /dev/shm)"
    )
    if free_bytes(fallback) < need_bytes:
        raise OSError(f"{short}, and {fallback} has {free_bytes(fallback) >> 20} MiB: {advice}, or free disk space")
    if fallback not in _said:
        _said.add(fallback)
        log.warning("%s: writing them to %s instead (disk-backed: slower loads); %s", short, fallback, advice)
    return fallback


def shared_memory_dir(need_bytes: int = 0) -> Path:
    """/dev/shm where it exists and may be written (memory-backed), if it has room for `need_bytes` (room_for:
    else the temporary directory, said once); the temporary directory on a machine without it."""
    if not (SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK)):
        return Path(tempfile.gettempdir())
    return room_for(SHARED_MEMORY, need_bytes)


def weights_store_dir(run_dir: Path, need_bytes: int = 0) -> Path:
    """Where the generators of one run on this machine keep their host copies of the weights (actors/weights/relay.py):
    in shared_memory_dir(need_bytes); the launcher removes it when the run ends (weights_store_dirs)."""
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return shared_memory_dir(need_bytes) / f"tandem-weights-{key}"


def weights_store_dirs(run_dir: Path) -> list[Path]:
    """Every place weights_store_dir may put one run's store: in /dev/shm, and where room_for falls back to."""
    store = weights_store_dir(run_dir)
    fallback = Path(tempfile.gettempdir()) / store.name
    return [store] if fallback == store else [store, fallback]
