"""What the GPU checks share: model shapes as config dicts (nothing is downloaded), random weights, checksums,
timing, the kernel probe and the stand-in for vLLM's model runner.

Every function takes the device it works on (`"cuda"`, or `"cpu"` for the tests' runs of the same code).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

BUCKET_BYTES = 128 << 20  # common.weights.DEFAULT_BUCKET_MB
GIB = 1 << 30

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": {  # 1.54e9 parameters, 3.09 GB in bfloat16
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen3-4b": {  # 4.02e9 parameters, 8.04 GB: for memory arithmetic only
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
    },
    "tinyllama-1.1b": {  # 1.10e9 parameters, 2.2 GB: the yardstick earlier results quote
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
    "learner-qwen2": {  # the learner check's model: Qwen2-shaped, tied, vocab 32k, 4 layers (2.4e7 parameters)
        "model_type": "qwen2",
        "vocab_size": 32000,
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "tiny-qwen2": {  # the CPU runs' model (tests)
        "model_type": "qwen2",
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
}

Layout = list[tuple[str, str, list[int]]]  # (name, dtype name, shape) in the model's parameter order
Weights = list[tuple[str, Any]]  # (name, tensor) in layout order


# ---------------------------------------------------------------------------------------------------- models
def hf_config(shape: str) -> Any:
    """The transformers config of SHAPES[shape]."""
    from transformers import AutoConfig

    values = dict(SHAPES[shape])
    return AutoConfig.for_model(values.pop("model_type"), max_position_embeddings=4096, **values)


def build_model(shape: str, device: str, seed: int) -> Any:
    """A causal LM of `shape` with random bfloat16 weights, built on `device` (eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.bfloat16).eval()


def named_weights(model: Any) -> Weights:
    """The model's parameters by name; a tied output layer is not listed (the publisher's layout)."""
    return [(name, param.detach()) for name, param in model.named_parameters()]


def layout_of(weights: Weights) -> Layout:
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in weights]


def layout_of_shape(shape: str) -> Layout:
    """The bfloat16 layout a learner publishes for `shape`, read from a model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.bfloat16)
    return layout_of(named_weights(model))


def layout_bytes(layout: Layout) -> int:
    import math

    from common.weights import storage_dtype

    return sum(math.prod(shape) * storage_dtype(dtype).itemsize for _, dtype, shape in layout)


def random_weights(layout: Layout, device: str, seed: int) -> Weights:
    """Fresh normal bfloat16 tensors of `layout` on `device`: a new update of the model's weights."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    weights = []
    for name, dtype, shape in layout:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        weights.append((name, tensor.normal_(generator=generator)))
    return weights


def checksum(weights: Iterable[tuple[str, Any]]) -> int:
    """Every byte of every tensor, summed with its position mixed in (a changed or moved byte changes it);
    computed on each tensor's own device."""
    import torch

    total = 0
    for index, (_, tensor) in enumerate(weights):
        words = tensor.contiguous().view(-1).view(torch.uint8).to(torch.int64)
        total += int((words * (index + 1)).sum() + words[::7919].sum() * 31)
    return total


# ---------------------------------------------------------------------------------------------------- timing
def synchronize(device: str) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    """(wall seconds, result) of `fn`, the device's queued work before and after it included."""
    synchronize(device)
    start = time.perf_counter()
    value = fn()
    synchronize(device)
    return time.perf_counter() - start, value


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def gb_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def peak_memory_gib(device: str) -> float:
    """Peak device memory allocated by this process (CUDA), else its peak resident memory."""
    import resource

    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.max_memory_allocated() / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


# ---------------------------------------------------------------------------------------------------- CUDA state
def kernel_probe(device: str) -> dict[str, Any]:
    """Launch one native kernel and say whether it raised: a CUDA error left pending by an earlier runtime call
    (a refused cudaHostRegister) surfaces at the next launch check, here instead of in the engine's next
    forward. Raising clears a non-sticky error, so one probe reports one earlier fault."""
    import torch

    try:
        value = (torch.arange(4096, device=device) * 2).sum().item()
    except RuntimeError as error:  # the finding itself: recorded, the check goes on
        return {"kernel_raises": True, "kernel_error": f"{type(error).__name__}: {error}"[:500]}
    return {"kernel_raises": False, "kernel_value_ok": value == 4095 * 4096}


def public_state(obj: Any) -> dict[str, Any]:
    """The plain public attributes of `obj` (bools, numbers, strings): what a class in flux says about itself."""
    return {
        key: value
        for key, value in vars(obj).items()
        if not key.startswith("_") and isinstance(value, bool | int | float | str)
    }


# ---------------------------------------------------------------------------------------------------- the engine
class StubModelRunner:
    """What `actors.weights.cuda.load_staged_pinned` / `load_ipc` use of vLLM's model runner: `device`,
    `model_config.hf_config` and `reload_weights(weights_iterator=)`, which copies each tensor into the
    transformers model's state-dict entry of that name (a tied output layer shares the embedding's storage).
    `names` records what the last reload received, in order."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.model_config = SimpleNamespace(hf_config=model.config)
        self.names: list[str] = []

    def reload_weights(self, weights_iterator: Iterable[tuple[str, Any]]) -> None:
        entries = self.model.state_dict(keep_vars=True)
        self.names = []
        for name, tensor in weights_iterator:
            entries[name].data.copy_(tensor)
            self.names.append(name)


def tied_head_check(model: Any, embedding: Any, names: Sequence[str]) -> dict[str, bool]:
    """For a tied model: the output layer equals the embedding just sent, and the loader shipped it by name."""
    import torch

    head = model.get_output_embeddings().weight
    return {"head_equals_embedding": bool(torch.equal(head, embedding)), "head_shipped": "lm_head.weight" in names}


# ---------------------------------------------------------------------------------------------------- files
def staging_dir(nbytes: int) -> Path:
    """/dev/shm when it has room for `nbytes` and a margin (where the generator stages), else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 1.5 * nbytes:
        return shm
    return Path(tempfile.gettempdir())
