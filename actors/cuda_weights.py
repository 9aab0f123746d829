"""CUDA receive paths for a weights update: host-staged through pinned memory, and CUDA IPC on one GPU.

Built for CUDA and never run on a GPU with vLLM (the lent GPU machine has no CUDA vLLM: its wheel does not fit in
what can be carried). `benchmarks/gpu_check.py` runs both producers below on a GPU, with a transformers model
standing in for the engine; vLLM's worker extension (`actors.engine.WeightLoader`) calls the same functions.

    # host-staged: the generator staged the update in a shared-memory file (actors/weights.py SharedMemoryStaging)
    for name, tensor in staged_to_device(path, tensors, device): ...      # tensors on `device`, one pinned copy each
    # CUDA IPC: the producer's buckets already lie on this GPU (a learner on the same GPU, or an nccl receiver)
    handles = export_buckets(buckets)                                     # producer: plain dicts (msgpack-able)
    for name, tensor in ipc_tensors(handles, tensors): ...                # consumer: views of the producer's memory

Host-staged: the file is mapped read-only and registered as pinned memory in place (`cudaHostRegister`, no copy
into a pinned buffer), so each tensor is one DMA from the page cache to the device (`non_blocking`). Where the
registration is refused (a kernel or driver that cannot pin file pages), the copies run from pageable memory
(slower: the driver stages them) and `staged_to_device` says so in `PinnedFile.pinned`. The mapping and the
registration live until every copy queued has finished (synchronised before unmapping).

CUDA IPC: each bucket is shared as one IPC handle (`torch.multiprocessing.reductions.reduce_tensor`, the form vLLM's
`ipc_engine` ships), written as plain values so that no serialiser of Python objects is needed to carry it; the
consumer's tensors are views into the producer's device memory (no host round trip, no copy until the loader copies
into its parameters). The producer must keep its buckets alive and unchanged until the consumer's load returned.
Both processes must see the same GPU (same device index or CUDA_VISIBLE_DEVICES mapping to the same physical GPU).

Failure modes: a dtype name the layout does not know raises AttributeError from torch (the header was checked by
`common.weights.check_frames` before); a handle from another machine or a freed allocation raises RuntimeError
from CUDA when opened.
"""

from __future__ import annotations

import mmap
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from actors.weights import WeightsUpdate

StagedTensor = tuple[str, str, list[int], int, int]  # (name, dtype name, shape, byte offset in the file, nbytes)
_CUDA_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the mapping is read-only


@dataclass
class DeviceWeightsUpdate(WeightsUpdate):
    """An update whose buckets lie in this process's GPU memory (an nccl broadcast receiver): `buckets` is empty,
    `device_buckets` holds the uint8 CUDA tensors laid out by the header. The engine hands them to its workers
    by CUDA IPC (`export_buckets`)."""

    device_buckets: list[Any] = field(default_factory=list)


class PinnedFile:
    """A file mapped read-only and registered as pinned host memory (see the module docstring). Context manager:
    on exit it waits for the copies queued on `device`, unregisters and unmaps. For a CPU `device` nothing is
    registered (`pinned` False): the same code then runs on CPU (tests/benchmarks/test_gpu_check.py)."""

    def __init__(self, path: str, device: Any) -> None:
        import torch

        self.device = torch.device(device)
        with open(path, "rb") as file:
            self.mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self.view = memoryview(self.mapped)
        with warnings.catch_warnings():  # torch warns that the buffer is read-only: nothing here writes it
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(self.view, dtype=torch.uint8)
        self.pinned = False
        if self.device.type == "cuda":
            result = torch.cuda.cudart().cudaHostRegister(
                self.bytes.data_ptr(), self.bytes.numel(), _CUDA_HOST_REGISTER_READ_ONLY
            )
            self.pinned = int(result) == 0  # cudaSuccess

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
        del self.bytes
        self.view.release()
        self.mapped.close()


def staged_to_device(path: str, tensors: Sequence[StagedTensor], device: Any) -> Iterator[tuple[str, Any]]:
    """(name, tensor on `device`) for every staged tensor, each copied once from the pinned mapping with
    `non_blocking` on the current stream (a consumer on that stream sees the data; others must synchronise).
    The copies are complete when the iterator is exhausted."""
    with PinnedFile(path, device) as staged:
        yield from device_copies(staged, tensors)


def device_copies(staged: PinnedFile, tensors: Sequence[StagedTensor]) -> Iterator[tuple[str, Any]]:
    """`staged_to_device` on a file already mapped and pinned (the caller closes it, after the last copy)."""
    import torch

    for name, dtype, shape, offset, nbytes in tensors:
        host = staged.bytes[offset : offset + nbytes].view(getattr(torch, dtype)).view(shape)
        target = torch.empty(shape, dtype=host.dtype, device=staged.device)
        target.copy_(host, non_blocking=staged.pinned)
        del host  # no view of the mapping may outlive it (closing it checks)
        yield name, target


def export_buckets(buckets: Sequence[Any]) -> list[dict[str, Any]]:
    """One CUDA IPC handle per bucket (uint8 CUDA tensors), as plain values (ints, bytes, bools)."""
    from torch.multiprocessing.reductions import reduce_tensor

    handles = []
    for bucket in buckets:
        _, args = reduce_tensor(bucket.detach())
        (_, size, _, offset, _, _, device, handle, size_bytes, offset_bytes, _, ref_handle, ref_offset, event, sync) = (
            args
        )
        handles.append(
            {
                "numel": int(size[0]),
                "tensor_offset": int(offset),
                "device": int(device),
                "handle": bytes(handle),
                "storage_bytes": int(size_bytes),
                "storage_offset": int(offset_bytes),
                "ref_counter_handle": bytes(ref_handle),
                "ref_counter_offset": int(ref_offset),
                "event_handle": bytes(event) if event is not None else None,
                "event_sync_required": bool(sync),
            }
        )
    return handles


def open_bucket(handle: dict[str, Any], device_index: int | None = None) -> Any:
    """The uint8 CUDA tensor a producer exported (`export_buckets`), opened on `device_index` (default: the
    producer's index). Raises RuntimeError from CUDA for a handle this process cannot open."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = handle["device"] if device_index is None else device_index
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([handle["numel"]]),
        (1,),
        handle["tensor_offset"],
        torch.storage.TypedStorage,
        torch.uint8,
        device,
        handle["handle"],
        handle["storage_bytes"],
        handle["storage_offset"],
        False,
        handle["ref_counter_handle"],
        handle["ref_counter_offset"],
        handle["event_handle"],
        handle["event_sync_required"],
    )


def ipc_tensors(
    handles: Sequence[dict[str, Any]], tensors: Sequence[tuple[str, str, list[int], int, int, int]]
) -> Iterator[tuple[str, Any]]:
    """(name, view into the producer's bucket) per (name, dtype name, shape, bucket, offset, nbytes)."""
    import torch

    buckets = [open_bucket(handle) for handle in handles]
    for name, dtype, shape, bucket, offset, nbytes in tensors:
        yield name, buckets[bucket][offset : offset + nbytes].view(getattr(torch, dtype)).view(shape)


def ipc_table(update: DeviceWeightsUpdate) -> list[tuple[str, str, list[int], int, int, int]]:
    """What `ipc_tensors` needs besides the handles: each tensor's (name, dtype, shape, bucket, offset, nbytes)."""
    return [(s.name, s.dtype, list(s.shape), s.bucket, s.offset, s.nbytes) for s in update.header.tensors]


def with_tied_head(weights: Iterator[tuple[str, Any]], hf_config: Any, names: set[str]) -> Iterator[tuple[str, Any]]:
    """`weights`, plus the new embedding as `lm_head.weight` for a tied model that ships no head (as the CPU path
    in `actors.engine.WeightLoader` does: vLLM's layerwise reload would otherwise restore the old head)."""
    tied = getattr(hf_config, "tie_word_embeddings", False) and "lm_head.weight" not in names
    for name, tensor in weights:
        yield name, tensor
        if tied and name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor


def load_staged_pinned(model_runner: Any, path: str, tensors: Sequence[StagedTensor]) -> dict[str, float | str]:
    """vLLM worker on CUDA: reload every staged tensor through pinned memory (vLLM's layerwise `reload_weights`).
    Returns where the time went, as `WeightLoader.tandem_load_shared_weights` does ("path": "pinned", or
    "pageable" where the registration was refused)."""
    import time

    started = time.perf_counter()
    names = {t[0] for t in tensors}
    with PinnedFile(path, model_runner.device) as staged:
        mapped = time.perf_counter()
        weights = with_tied_head(device_copies(staged, tensors), model_runner.model_config.hf_config, names)
        model_runner.reload_weights(weights_iterator=weights)
    done = time.perf_counter()
    path_name = "pinned" if staged.pinned else "pageable"
    return {"path": path_name, "map_s": mapped - started, "load_s": done - mapped, "process_s": 0.0}


def load_ipc(model_runner: Any, handles: Sequence[dict[str, Any]], tensors: Sequence[Any]) -> dict[str, float | str]:
    """vLLM worker on CUDA: reload from the producer's device buckets by CUDA IPC (the same return as
    `load_staged_pinned`, "path": "ipc"; map_s is the opening of the handles)."""
    import time

    import torch

    started = time.perf_counter()
    names = {t[0] for t in tensors}
    views = list(ipc_tensors(handles, tensors))
    opened = time.perf_counter()
    model_runner.reload_weights(
        weights_iterator=with_tied_head(iter(views), model_runner.model_config.hf_config, names)
    )
    torch.cuda.synchronize(model_runner.device)  # the producer may reuse its buckets once this returns
    return {"path": "ipc", "map_s": opened - started, "load_s": time.perf_counter() - opened, "process_s": 0.0}
