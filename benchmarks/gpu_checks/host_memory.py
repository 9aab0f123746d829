"""C1: host-staged copies, how host memory gets pinned, and CUDA's error state after a refused registration.

Each variant runs in a process of its own (the runner's), on a staged file of `size_mib` (2 GiB on the GPU): a
seeded random 64 MiB block repeated, in the staging directory (/dev/shm when it has room), read as 128 MiB uint8
tensors. The variants copy it to the device:

  (a) Tandem's `actors.weights.cuda` as it is in the tree at run time, through its public entry points: a
      `PinnedFile` opened and closed (its path, "pinned" | "bounce" | "pageable", and public state recorded),
      `load_staged_pinned` into a stand-in model runner (the path it reports taking), then `staged_to_device`
      twice; one native kernel after each of the first two;
  (b) the old way by hand: an ACCESS_READ mapping registered with cudaHostRegisterReadOnly, then the kernel;
  (c) an ACCESS_COPY (private) mapping registered with flags 0, then the kernel (the kernel copies each page
      as it pins it: see register_s);
  (d) a persistent 2 x 256 MiB pinned bounce buffer: chunks memcpy'd into one half while the other half's
      copy to the device runs;
  (e) plain pageable copies from the mapping.

Figures per variant: first_s (the first pass: page faults, and for (a) the mapping and registration), warm_s (the
median of later passes) and their GB/s; for (b) and (c) register_s / unregister_s, the registration's result code,
and update_gb_s, one update with its own registration (what registering per update costs). Every pass's bytes are
checked against the pattern on the device.

Pass: the bytes arrive, and in (a) no kernel after Tandem's code raises (a refused registration must not leave an
error behind). (b)'s kernel probe is recorded, not judged: with HostRegisterReadOnlySupported = 0 (C0) the
registration is refused and, since torch's binding leaves the error pending, the next kernel is expected to raise.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from types import SimpleNamespace
from typing import Any, Self

from benchmarks.gpu_checks.shared import gb_per_s, kernel_probe, median, public_state, staging_dir, timed

CHUNK_BYTES = 128 << 20  # one staged tensor, as a weights bucket
PATTERN_BYTES = 64 << 20
BOUNCE_BYTES = 256 << 20  # each half of the bounce buffer
HOST_REGISTER_DEFAULT = 0x00
HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly
PASSES = 3


# ---------------------------------------------------------------------------------------------------- the checks
def check_tandem_pinned_file(device: str, size_mib: int) -> dict[str, Any]:
    """(a) Tandem's own code, as it is now: which path it takes, and whether CUDA is still usable after it."""
    from actors.weights.cuda import PinnedFile, load_staged_pinned, staged_to_device

    nbytes = size_mib << 20
    with staged_file(nbytes) as (path, pattern):
        tensors = file_tensors(nbytes)
        with PinnedFile(path, device) as staged:
            state = {"path": staged.path, **public_state(staged)}
        after_pinned_file = kernel_probe(device)
        runner = FileRunner(tensors, nbytes, device)
        first_s, report = timed(lambda: load_staged_pinned(runner, path, tensors), device)
        after_load = kernel_probe(device)
        equal = [arrived(runner.target, pattern)]
        warm = []
        for _ in range(PASSES - 1):
            runner.target.zero_()
            warm.append(timed(lambda: runner.reload_weights(staged_to_device(path, tensors, device)), device)[0])
            equal.append(arrived(runner.target, pattern))
    return {
        "ok": all(equal) and not after_pinned_file["kernel_raises"] and not after_load["kernel_raises"],
        "path": report["path"],
        "load_report": report,
        "pinned_file": state,
        "after_pinned_file": after_pinned_file,
        "after_load": after_load,
        "bytes_equal": all(equal),
        **rates(nbytes, [first_s, *warm]),
    }


def check_read_only_register(device: str, size_mib: int) -> dict[str, Any]:
    """(b) ACCESS_READ + cudaHostRegisterReadOnly, the registration `PinnedFile` did before issue 31."""
    return registered_copies(size_mib << 20, mmap.ACCESS_READ, HOST_REGISTER_READ_ONLY)


def check_copy_on_write_register(device: str, size_mib: int) -> dict[str, Any]:
    """(c) ACCESS_COPY + flags 0: a private writable mapping, which x86 hosts register."""
    return registered_copies(size_mib << 20, mmap.ACCESS_COPY, HOST_REGISTER_DEFAULT)


def check_bounce_buffer(device: str, size_mib: int, bounce_mib: int = BOUNCE_BYTES >> 20) -> dict[str, Any]:
    """(d) A persistent pinned buffer of 2 halves: memcpy into one while the other's copy to the device runs."""
    import torch

    nbytes = size_mib << 20
    allocate_s, halves = timed(lambda: bounce_halves(bounce_mib << 20, device), device)
    with staged_file(nbytes) as (path, pattern), Mapping(path, mmap.ACCESS_READ) as mapping:
        target = torch.empty(nbytes, dtype=torch.uint8, device=device)
        times, equal = passes(lambda: copy_through(mapping.bytes, target, halves), target, pattern, device)
    return {"ok": all(equal), "bytes_equal": all(equal), "allocate_s": allocate_s, **rates(nbytes, times)}


def check_pageable(device: str, size_mib: int) -> dict[str, Any]:
    """(e) Plain copies from the pageable mapping (the driver stages them through its own pinned buffer)."""
    import torch

    nbytes = size_mib << 20
    with staged_file(nbytes) as (path, pattern), Mapping(path, mmap.ACCESS_READ) as mapping:
        target = torch.empty(nbytes, dtype=torch.uint8, device=device)
        times, equal = passes(lambda: copy_chunks(mapping.bytes, target, non_blocking=False), target, pattern, device)
    return {"ok": all(equal), "bytes_equal": all(equal), **rates(nbytes, times)}


def registered_copies(nbytes: int, access: int, flags: int) -> dict[str, Any]:
    """Map the staged file with `access`, register it with `flags`, probe a kernel, copy it `PASSES` times
    (non-blocking when registered, else pageable), unregister."""
    import torch

    with staged_file(nbytes) as (path, pattern), Mapping(path, access) as mapping:
        register_s, code = timed(lambda: mapping.register(flags), "cuda")
        probe = kernel_probe("cuda")
        target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        copy = partial(copy_chunks, mapping.bytes, target, non_blocking=code == 0)
        times, equal = passes(copy, target, pattern, "cuda")
        unregister_s = timed(mapping.unregister, "cuda")[0]
    return {
        "ok": all(equal),
        "bytes_equal": all(equal),
        "register_code": code,
        "register_error": error_name(code),
        "registered": code == 0,
        "register_s": register_s,
        "unregister_s": unregister_s,
        "after_register": probe,
        "update_gb_s": gb_per_s(nbytes, register_s + times[0] + unregister_s),
        **rates(nbytes, times),
    }


# ---------------------------------------------------------------------------------------------------- copies
def copy_chunks(host: Any, target: Any, non_blocking: bool) -> None:
    for start in range(0, host.numel(), CHUNK_BYTES):
        end = min(start + CHUNK_BYTES, host.numel())
        target[start:end].copy_(host[start:end], non_blocking=non_blocking)


def bounce_halves(half_bytes: int, device: str) -> list[Any]:
    """Two pinned host buffers (plain ones when `device` is the CPU: nothing to pin for)."""
    import torch

    pin = device.startswith("cuda")
    return [torch.empty(half_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]


def copy_through(host: Any, target: Any, halves: list[Any]) -> None:
    """host -> a pinned half (memcpy) -> target (non-blocking), alternating halves; a half is refilled only after
    its previous copy to the device finished (its event)."""
    import torch

    cuda = target.device.type == "cuda"
    done: list[Any] = [None, None]
    half_bytes = halves[0].numel()
    for index, start in enumerate(range(0, host.numel(), half_bytes)):
        end, slot = min(start + half_bytes, host.numel()), index % 2
        if done[slot] is not None:
            done[slot].synchronize()
        halves[slot][: end - start].copy_(host[start:end])
        target[start:end].copy_(halves[slot][: end - start], non_blocking=cuda)
        if cuda:
            done[slot] = torch.cuda.Event()
            done[slot].record()


def passes(copy: Callable[[], None], target: Any, pattern: Any, device: str) -> tuple[list[float], list[bool]]:
    """Seconds of `PASSES` runs of `copy` into `target` (cleared before each), and whether each delivered."""
    times, equal = [], []
    for _ in range(PASSES):
        target.zero_()
        times.append(timed(copy, device)[0])
        equal.append(arrived(target, pattern))
    return times, equal


def rates(nbytes: int, times: list[float]) -> dict[str, float]:
    warm = median(times[1:]) if len(times) > 1 else times[0]
    return {
        "bytes": nbytes,
        "first_s": times[0],
        "warm_s": warm,
        "first_gb_s": gb_per_s(nbytes, times[0]),
        "warm_gb_s": gb_per_s(nbytes, warm),
    }


def arrived(target: Any, pattern: Any) -> bool:
    """Whether `target` holds the staged file: the pattern block over and over."""
    return bool(target.view(-1, pattern.numel()).eq(pattern.to(target.device)).all())


# ---------------------------------------------------------------------------------------------------- files
@contextmanager
def staged_file(nbytes: int) -> Iterator[tuple[str, Any]]:
    """(path, pattern): a file of `nbytes` in the staging directory, a seeded random block repeated; deleted after."""
    import torch

    block = min(PATTERN_BYTES, nbytes)
    if nbytes % block:
        raise ValueError(f"the staged file's size ({nbytes}) must be a multiple of {block} bytes")
    pattern = torch.randint(0, 256, (block,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    fd, path = tempfile.mkstemp(prefix="tandem-gpu-check-", dir=staging_dir(nbytes))
    try:
        with os.fdopen(fd, "wb") as file:
            for _ in range(nbytes // block):
                file.write(memoryview(pattern.numpy()))
        yield path, pattern
    finally:
        os.unlink(path)


def file_tensors(nbytes: int) -> list[tuple[str, str, list[int], int, int]]:
    """The staged file as `actors.weights.cuda.StagedTensor`s: uint8 chunks of `CHUNK_BYTES`."""
    sizes = [(start, min(CHUNK_BYTES, nbytes - start)) for start in range(0, nbytes, CHUNK_BYTES)]
    return [(f"chunk.{i}", "uint8", [size], start, size) for i, (start, size) in enumerate(sizes)]


class Mapping:
    """The file mapped with `access`, its bytes a uint8 CPU tensor (`bytes`), optionally registered with CUDA.
    Context manager: unregisters, drops the tensor and unmaps on exit."""

    def __init__(self, path: str, access: int) -> None:
        import torch

        with open(path, "rb") as file:
            self.region = mmap.mmap(file.fileno(), 0, access=access)
        self.view = memoryview(self.region)
        with warnings.catch_warnings():  # a read-only buffer: nothing here writes it
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(self.view, dtype=torch.uint8)
        self.registered = False

    def register(self, flags: int) -> int:
        """cudaHostRegister through torch's binding (which leaves a failure's error pending); the result code."""
        import torch

        code = int(torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.bytes.numel(), flags))
        self.registered = code == 0
        return code

    def unregister(self) -> None:
        import torch

        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.registered = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.unregister()
        self.bytes = None
        self.view.release()
        self.region.close()


def error_name(code: int) -> str:
    """CUDA's description of a runtime result code (ctypes on libcudart: torch binds only cudaSuccess by name)."""
    import ctypes

    from benchmarks.gpu_checks.environment import libcudart

    library = libcudart()
    if library is None:
        return f"cudaError {code}"
    library.cudaGetErrorString.restype = ctypes.c_char_p
    return library.cudaGetErrorString(ctypes.c_int(code)).decode()


class FileRunner:
    """vLLM's model runner as `load_staged_pinned` uses it, for a bare file: each `chunk.<i>` it is given is
    copied into its slice of `target` (one device tensor the size of the file)."""

    def __init__(self, tensors: list[tuple[str, str, list[int], int, int]], nbytes: int, device: str) -> None:
        import torch

        self.device = torch.device(device)
        self.model_config = SimpleNamespace(hf_config=SimpleNamespace(tie_word_embeddings=False))
        self.target = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.slots = {name: (offset, size) for name, _, _, offset, size in tensors}

    def reload_weights(self, weights_iterator: Iterator[tuple[str, Any]]) -> None:
        for name, tensor in weights_iterator:
            offset, size = self.slots[name]
            self.target[offset : offset + size].copy_(tensor)
