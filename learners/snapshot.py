"""A version's host copy of the weights, as the ZeroMQ publisher (learners/publisher.py) serves it: its buckets,
how a publish fills them, and when they may be written again.

    snapshot = copy_into_snapshot(version, layout, weights, bucket_bytes, reusable_buckets)   # the training thread
    buckets_reusable(snapshot)        # nothing can read its buckets any more: the next publish may overwrite them

Buckets are laid out by `common.weights.plan_buckets` (alignment gaps zeroed). Weights on a CUDA device go into
pinned buckets (page-locked torch tensors viewed as numpy), copied without blocking, with one wait per publish.
A bucket is read by zero-copy reply frames until ZeroMQ sent them; CPython's reference count says when none is
left (`buckets_reusable`).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from common.config import LoraConfig
from common.weight_messages import WeightsHeader
from common.weights import plan_buckets, storage_dtype

Layout = Sequence[tuple[str, str, Sequence[int]]]  # (HF name, dtype name, shape) per tensor, in publish order


@dataclass
class Snapshot:
    """One version: its header and bucket buffers (written only while no reply can reach them)."""

    header: WeightsHeader
    buckets: list[np.ndarray]  # uint8 [bucket_sizes[i]]
    readers: int = 0  # serving threads about to send it (guarded by the publisher's lock)
    chunk_bytes: int = 0  # relay: the chunking of `digests` (0: not chunked, star only)
    digests: list[str] = field(default_factory=list)  # relay: sha256 of each chunk, once computed (see _digest)
    digesting: bool = False  # relay: the sealing thread computes `digests`

    def relay_header(self, parent: str, depth: int) -> WeightsHeader:
        """The header a relay receiver gets from the publisher: the layout, its parent, and every chunk's digest
        (empty for a generator fed by the publisher: it checks nothing)."""
        return replace(
            self.header,
            transport="relay",
            chunk_bytes=self.chunk_bytes,
            chunk_digests=self.digests if needs_digests(parent) else [],
            parent=parent,
            depth=depth,
        )

    @property
    def version(self) -> int:
        return self.header.policy_version


def needs_digests(parent: str) -> bool:
    """Whether a receiver of this parent checks what it gets: one fed by another generator, a relay's chunks or
    its host's copy (only the publisher's own chunks, over the connection its header came on, are trusted)."""
    return parent != ""


def _bucket_refcounts(buckets: list[np.ndarray]) -> list[int]:
    return [sys.getrefcount(bucket) for bucket in buckets]


# References an idle bucket has when counted by `_bucket_refcounts` (its list slot, the loop, the call).
_IDLE_REFCOUNT = _bucket_refcounts([np.empty(1, dtype=np.uint8)])[0]


def buckets_reusable(snapshot: Snapshot) -> bool:
    """True when nothing can read `snapshot`'s buckets: no serving thread is about to send it and no object
    but the snapshot references them (a zero-copy frame in flight holds a reference until ZeroMQ sent it)."""
    if snapshot.digesting and not snapshot.digests:  # the sealing thread is about to read them
        return False
    return snapshot.readers == 0 and all(c <= _IDLE_REFCOUNT for c in _bucket_refcounts(snapshot.buckets))


def copy_into_snapshot(
    version: int,
    layout: Layout,
    weights: Iterable[tuple[str, Any]],
    bucket_bytes: int,
    buckets: list[np.ndarray] | None = None,
    adapter: LoraConfig | None = None,
) -> Snapshot:
    """Copy every tensor into buckets laid out by `common.weights.plan_buckets`: `buckets` when given (their
    sizes must match the plan; nothing else may read them meanwhile), else freshly allocated ones. `adapter`:
    the weights are a LoRA adapter's A and B matrices (learner.lora.sync = "adapter"), whose settings the header
    carries (`lora_rank`, `lora_alpha`, `lora_target_modules`); None: full weights.

    `weights` yields (name, torch tensor or numpy array) in `layout` order with the layout's dtypes and shapes;
    raises ValueError on any mismatch (a different model than the layout describes).

    Weights on a CUDA device (the first tensor says) are copied into pinned buckets (`buckets` when they are
    pinned, else new pinned ones: page-locked torch tensors viewed as numpy), each copy queued `non_blocking` on
    the device's current stream, and the host waits once, after the last (or on an error), for that stream.
    A yielded tensor may be freed as soon as the next is asked for: its memory is not reused before its copy ran.
    """
    specs, sizes = plan_buckets(list(layout), bucket_bytes)
    weights = iter(weights)
    first = next(weights, None)
    device = None if first is None else _cuda_device(first[1])
    if buckets is None or [b.nbytes for b in buckets] != sizes or (device is not None and not _pinned(buckets)):
        buckets = _pinned_buckets(sizes) if device is not None else [np.empty(size, dtype=np.uint8) for size in sizes]
    ordered = itertools.chain([] if first is None else [first], weights)
    written = [0] * len(sizes)
    count = 0
    try:
        for spec, (name, tensor) in zip(specs, ordered, strict=True):
            if name != spec.name:
                raise ValueError(f"weights arrive out of layout order: got '{name}', expected '{spec.name}'")
            target = buckets[spec.bucket][spec.offset : spec.offset + spec.nbytes]
            buckets[spec.bucket][written[spec.bucket] : spec.offset] = 0  # alignment gap: zero bytes
            _copy_bytes(tensor, target, spec.dtype, spec.shape, name, non_blocking=device is not None)
            written[spec.bucket] = spec.offset + spec.nbytes
            count += 1
    finally:
        if device is not None:
            _wait_for_copies(device)  # once per publish: the buckets are complete (or, on an error, left alone)
    if count != len(specs):
        raise ValueError(f"{count} tensors arrived, the layout has {len(specs)}")
    header = WeightsHeader(policy_version=version, tensors=specs, bucket_sizes=sizes)
    if adapter is not None:
        header = replace(
            header,
            lora_rank=adapter.rank,
            lora_alpha=float(adapter.alpha),
            lora_target_modules=list(adapter.target_modules),
        )
    return Snapshot(header, buckets)


def _copy_bytes(
    tensor: Any, target: np.ndarray, dtype_name: str, shape: Sequence[int], name: str, non_blocking: bool = False
) -> None:
    """Copy `tensor` into `target`, its slot; `non_blocking`: a CUDA tensor into pinned memory, queued on its
    device's current stream (the caller waits for it)."""
    if list(tensor.shape) != list(shape):
        raise ValueError(f"weights '{name}': shape {list(tensor.shape)} != layout {list(shape)}")
    if isinstance(tensor, np.ndarray):
        if storage_dtype(dtype_name) != tensor.dtype and not (dtype_name == "bfloat16" and tensor.dtype == np.uint16):
            raise ValueError(f"weights '{name}': dtype {tensor.dtype} != layout {dtype_name}")
        np.copyto(target.view(tensor.dtype).reshape(tensor.shape), tensor)
        return
    import torch

    if str(tensor.dtype).removeprefix("torch.") != dtype_name:
        raise ValueError(f"weights '{name}': dtype {tensor.dtype} != layout {dtype_name}")
    destination = torch.from_numpy(target).view(tensor.dtype).view(tensor.shape)
    source = tensor.detach()
    if non_blocking and source.is_cuda:  # its producer may free it before the copy ran: keep the memory till then
        source.record_stream(torch.cuda.current_stream(source.device))
    destination.copy_(source, non_blocking=non_blocking)


def _cuda_device(tensor: Any) -> Any:
    """The CUDA device `tensor` lies on; None for a CPU tensor or a numpy array."""
    device = getattr(tensor, "device", None)
    return device if getattr(device, "type", None) == "cuda" else None


def _pinned(buckets: Sequence[np.ndarray]) -> bool:
    """Whether every bucket is a view of a page-locked torch tensor (`_pinned_buckets`)."""
    return all(getattr(bucket.base, "is_pinned", lambda: False)() for bucket in buckets)


def _pinned_buckets(sizes: Sequence[int]) -> list[np.ndarray]:
    """Page-locked host buckets, as numpy views of pinned torch tensors (each view keeps its tensor alive, and a
    view of it references the view, so `buckets_reusable` counts the frames in flight as for numpy buckets)."""
    import torch

    return [torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy() for size in sizes]


def _wait_for_copies(device: Any) -> None:
    """Block until the copies queued on `device`'s current stream have run (that stream only, not the device)."""
    import torch

    torch.cuda.current_stream(device).synchronize()
