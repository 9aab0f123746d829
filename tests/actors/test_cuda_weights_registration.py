"""actors/cuda_weights.PinnedFile on a CUDA device made of fakes (review finding 4): read-only registration is
asked for only where the device says it supports it, a refused registration leaves no CUDA error pending (torch
would raise it from the next kernel launch), and the path taken is reported honestly. The copies themselves are
in test_cuda_weights_bounce.py (CPU) and benchmarks/gpu_check.py (GPU)."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from actors.weights import cuda as cuda_weights
from actors.weights.cuda import PinnedFile

CUDA_ERROR_NOT_SUPPORTED = 801  # what a B300 x86 host answered to a read-only registration (vllm-omni#6240)
CUDA_ERROR_INVALID_VALUE = 1


class FakeCudart:
    """`torch.cuda.cudart()` as far as PinnedFile uses it; records what it is asked."""

    def __init__(self, register_result: int, unregister_result: int) -> None:
        self.register_result, self.unregister_result = register_result, unregister_result
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # the CUDA names
        self.registered.append((ptr, size, flags))
        return self.register_result

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return self.unregister_result


class FakeRuntimeLibrary:
    """The CUDA runtime library torch loaded, as far as clearing its last error goes."""

    def __init__(self) -> None:
        self.cleared = 0

    def cudaGetLastError(self) -> int:
        self.cleared += 1
        return CUDA_ERROR_NOT_SUPPORTED


def fake_cuda(monkeypatch, read_only_supported: int, register_result: int, unregister_result: int = 0):
    """Device 0 as a fresh process sees it: cuda.bindings answers the read-only attribute, torch's cudart
    registers (or not), synchronising is a no-op, and two small CPU tensors stand in for the pinned buffers."""
    asked: list[int] = []

    def get_attribute(attribute: str, device: int) -> tuple[int, int]:
        assert attribute == "cudaDevAttrHostRegisterReadOnlySupported"
        asked.append(device)
        return 0, read_only_supported

    runtime = SimpleNamespace(
        cudaDeviceAttr=SimpleNamespace(
            cudaDevAttrHostRegisterReadOnlySupported="cudaDevAttrHostRegisterReadOnlySupported"
        ),
        cudaError_t=SimpleNamespace(cudaSuccess=0),
        cudaDeviceGetAttribute=get_attribute,
    )
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = runtime  # type: ignore[attr-defined]
    package = types.ModuleType("cuda")
    package.bindings = bindings  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cuda", package)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", runtime)
    cudart, library = FakeCudart(register_result, unregister_result), FakeRuntimeLibrary()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    # the module's per-process state, fresh (raising=False: the fakes above still apply to a PinnedFile without it)
    monkeypatch.setattr(cuda_weights, "_READ_ONLY_SUPPORTED", {}, raising=False)
    monkeypatch.setattr(
        cuda_weights, "_BOUNCE", [[torch.empty(64, dtype=torch.uint8) for _ in range(2)]], raising=False
    )
    monkeypatch.setattr(cuda_weights, "_cudart_library", lambda: library, raising=False)
    return SimpleNamespace(asked=asked, cudart=cudart, library=library)


@pytest.fixture
def staged_file(tmp_path):
    path = tmp_path / "staged"
    path.write_bytes(bytes(range(256)) * 16)
    return str(path)


def test_read_only_registration_is_not_attempted_where_the_device_does_not_support_it(monkeypatch, staged_file) -> None:
    cuda = fake_cuda(monkeypatch, read_only_supported=0, register_result=CUDA_ERROR_NOT_SUPPORTED)
    for _ in range(2):
        with PinnedFile(staged_file, "cuda:0") as staged:
            assert cuda.cudart.registered == []  # never asked: the refusal would leave an error behind
            assert not staged.pinned and staged.path == "bounce"
    assert cuda.asked == [0]  # once per process


def test_a_refused_registration_clears_the_error_and_copies_through_bounce_buffers(monkeypatch, staged_file) -> None:
    cuda = fake_cuda(monkeypatch, read_only_supported=1, register_result=CUDA_ERROR_NOT_SUPPORTED)
    with PinnedFile(staged_file, "cuda:0") as staged:
        assert [(size, flags) for _, size, flags in cuda.cudart.registered] == [(4096, 0x08)]  # read-only
        assert cuda.library.cleared == 1  # the next kernel launch will not raise "operation not supported"
        assert not staged.pinned and staged.path == "bounce"
    with PinnedFile(staged_file, "cuda:0") as staged:
        assert len(cuda.cudart.registered) == 1 and staged.path == "bounce"  # refused once: not asked again
    assert cuda.cudart.unregistered == []


def test_a_registered_file_is_unregistered_and_a_failed_unregistration_cleared(monkeypatch, staged_file) -> None:
    cuda = fake_cuda(monkeypatch, read_only_supported=1, register_result=0, unregister_result=CUDA_ERROR_INVALID_VALUE)
    with PinnedFile(staged_file, "cuda:0") as staged:
        ((ptr, size, _),) = cuda.cudart.registered
        assert size == 4096 and staged.pinned
    assert cuda.cudart.unregistered == [ptr]
    assert cuda.library.cleared == 1
    assert staged.path == "pinned"
