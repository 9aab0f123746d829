"""C0: what the machine is. Versions (torch, CUDA, driver, NCCL), the GPU, /dev/shm's size and free space, the
device attributes that decide how host memory can be pinned, and which of the carried modules import.

Device attributes come from `cuda.bindings.runtime` (a dependency of CUDA torch 2.13) when it imports, else from
the libcudart that torch loaded, through ctypes. Recorded, never judged: the check passes when it ran.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import platform
import shutil
from pathlib import Path
from typing import Any

# cudaDeviceAttr values (driver_types.h)
ATTRIBUTES = {
    "ClockRate": 13,  # kHz
    "PageableMemoryAccess": 88,
    "HostRegisterSupported": 99,
    "PageableMemoryAccessUsesHostPageTables": 100,
    "HostRegisterReadOnlySupported": 113,
}
CARRIED = {  # module: its distribution (vllm: never on the lent machine, listed to say so)
    "deepspeed": "deepspeed",
    "zmq": "pyzmq",
    "pydantic": "pydantic",
    "msgpack": "msgpack",
    "transformers": "transformers",
    "cuda.bindings": "cuda-bindings",
    "vllm": "vllm",
}


def check_environment(device: str) -> dict[str, Any]:
    import torch

    figures: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "modules": {name: module_version(name) for name in CARRIED},
        "dev_shm": shm_space(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        figures.update(
            gpu=props.name,
            gpu_memory_gib=props.total_memory / (1 << 30),
            compute_capability=f"{props.major}.{props.minor}",
            nccl=".".join(str(part) for part in torch.cuda.nccl.version()),
            driver=driver_version(),
            attributes=device_attributes(0),
        )
    return {"ok": True, **figures}


def module_version(name: str) -> str | None:
    """The installed version of the module's distribution, None when the module is not importable from here
    (found without importing it: vLLM's import alone takes seconds)."""
    try:
        if importlib.util.find_spec(name) is None:
            return None
    except ModuleNotFoundError:  # a parent package is missing (cuda, for cuda.bindings)
        return None
    try:
        return importlib.metadata.version(CARRIED[name])
    except importlib.metadata.PackageNotFoundError:
        return "present"


def shm_space() -> dict[str, Any]:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return {"present": False}
    usage = shutil.disk_usage(shm)
    return {"present": True, "size_gib": usage.total / (1 << 30), "free_gib": usage.free / (1 << 30)}


def device_attributes(device_index: int, names: tuple[str, ...] = tuple(ATTRIBUTES)) -> dict[str, Any]:
    """{attribute name: value} for the CUDA device, plus "source": which binding answered."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return _attributes_by_ctypes(device_index, names)
    values: dict[str, Any] = {"source": "cuda.bindings.runtime"}
    for name in names:
        error, value = runtime.cudaDeviceGetAttribute(
            getattr(runtime.cudaDeviceAttr, f"cudaDevAttr{name}"), device_index
        )
        values[name] = int(value) if int(error) == 0 else f"error {int(error)}"
    return values


def driver_version() -> str | None:
    """The driver's CUDA version, as "major.minor" (13000 -> "13.0"); None when no binding answers."""
    error, version = _driver_version()
    return f"{version // 1000}.{version % 1000 // 10}" if error == 0 else None


def _driver_version() -> tuple[int, int]:
    try:
        from cuda.bindings import runtime
    except ImportError:
        library, value = libcudart(), ctypes.c_int()
        if library is None:
            return -1, 0
        return library.cudaDriverGetVersion(ctypes.byref(value)), value.value
    error, version = runtime.cudaDriverGetVersion()
    return int(error), int(version)


def _attributes_by_ctypes(device_index: int, names: tuple[str, ...]) -> dict[str, Any]:
    library = libcudart()
    if library is None:
        return {"source": "none: neither cuda.bindings nor a libcudart was found"}
    values: dict[str, Any] = {"source": f"ctypes {library._name}"}
    for name in names:
        value = ctypes.c_int()
        error = library.cudaDeviceGetAttribute(ctypes.byref(value), ctypes.c_int(ATTRIBUTES[name]), device_index)
        values[name] = value.value if error == 0 else f"error {error}"
    return values


def libcudart() -> ctypes.CDLL | None:
    """The libcudart this process already loaded (torch's), else one the loader finds, else None."""
    with open("/proc/self/maps") as maps:
        loaded = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    for path in [*loaded, ctypes.util.find_library("cudart")]:
        if path:
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None
