"""Weights on the wire: a name -> array dict laid out in buckets of at most N MiB, checked and viewed without copies.

The learner's publisher and the generator's receiver both follow this layout, and nothing else:

    publisher (learner, learners/publisher.py)              receiver (generator, actors/weights.py)
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

Request/reply (what the generator's receiver expects of the publisher): `WeightsRequest(generator_id, have_version)`
is answered with `WeightsHeader` (transport "zmq") + the buckets as payload frames when the publisher's version is
newer than `have_version`, else with `WeightsNotNewer(latest_version)`. The publisher may instead hold a request
that has nothing newer (a long poll, with a deferred reply) and answer it the moment it publishes, or with
`WeightsNotNewer` after at most 60 s (the generator waits up to 120 s for a reply). Holding cuts the sync latency
by the generator's polling period (1 s, 0.2 s while the buffer is waiting for a newer version).

Failure modes: `plan_buckets` and `storage_dtype` raise `ValueError` for a bucket size <= 0 or a dtype name they do
not know; `check_frames` raises `WeightsLayoutError` when the frames do not match the header (count, sizes, a spec
whose bytes disagree with its shape or lie outside its bucket). Imports numpy only (no torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from common.types import TensorSpec, WeightsHeader

ALIGN = 64
DEFAULT_BUCKET_MB = 128.0

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
    """The buckets as byte memoryviews, after checking they match the header; raises `WeightsLayoutError`."""
    views = [_byte_view(b) for b in buckets]
    if len(views) != len(header.bucket_sizes):
        raise WeightsLayoutError(f"header announces {len(header.bucket_sizes)} buckets, {len(views)} frames came")
    for index, (view, size) in enumerate(zip(views, header.bucket_sizes)):
        if view.nbytes != size:
            raise WeightsLayoutError(f"bucket {index}: {view.nbytes} bytes arrived, header says {size}")
    for spec in header.tensors:
        expected = int(np.prod(spec.shape, dtype=np.int64)) * storage_dtype(spec.dtype).itemsize
        if spec.nbytes != expected:
            raise WeightsLayoutError(f"tensor '{spec.name}': nbytes {spec.nbytes} != shape {spec.shape} x itemsize")
        inside = 0 <= spec.bucket < len(views) and spec.offset >= 0
        if not inside or spec.offset + spec.nbytes > views[spec.bucket].nbytes:
            raise WeightsLayoutError(f"tensor '{spec.name}': bytes outside bucket {spec.bucket}")
    return views


def _byte_view(frame: Any) -> memoryview:
    view = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)  # zmq.Frame or any buffer
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def total_bytes(header: WeightsHeader) -> int:
    """Bytes of all buckets of an update (what travels)."""
    return int(sum(header.bucket_sizes))
