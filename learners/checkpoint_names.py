"""The learner's parameters under their checkpoint names and layouts: what vLLM's `load_weights` and
`AutoModelForCausalLM.from_pretrained` read.

    layout = checkpoint_layout(model, [(name, dtype, shape), ...])     # no gather, no tensor touched
    for name, tensor in checkpoint_weights(model, named_tensors): ...  # streamed, one parameter at a time

transformers 5 loads some architectures into another layout than their checkpoints hold, and `save_pretrained`
converts back (transformers.core_model_loading.revert_weight_conversion). In memory a mixture-of-experts layer
keeps all its experts in two fused 3-D parameters, `mlp.experts.gate_up_proj` [E, 2I, H] and
`mlp.experts.down_proj` [E, H, I], where the checkpoint (and vLLM) has `mlp.experts.{e}.gate_proj.weight` [I, H] and
so on per expert; Mixtral's also renames `block_sparse_moe.` to `mlp.` and w1/w3/w2 to gate/up/down. Publishing
`named_parameters` as they are gave vLLM names it has no parameter for, and an HF export that transformers could
only read back through its in-memory names. Dense families (Llama, Qwen, Gemma, Mistral, Phi-3) have no conversion
and pass through unchanged, name for name.

Each parameter is reverted on its own, with the conversions the model was loaded with (`_weight_conversions`), which
is exact because every conversion of these families reads one in-memory tensor (tests/benchmarks/test_architectures.py
checks the result against `save_pretrained`'s file for every tiny family). The tensors yielded are views of the one
given: valid as long as it is (under ZeRO-3 until the next parameter is gathered).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn


def _hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (its conversions are the base model's)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _conversions(model: nn.Module) -> list[Any]:
    return list(getattr(_hf_model(model), "_weight_conversions", None) or [])


def _revert(model: nn.Module, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    reverted = revert_weight_conversion(_hf_model(model), {name: tensor})
    if not reverted:
        raise RuntimeError(f"transformers' weight conversion of {type(model).__name__} dropped parameter {name}")
    return reverted


def checkpoint_layout(model: nn.Module, layout: list[tuple[str, Any, list[int]]]) -> list[tuple[str, Any, list[int]]]:
    """(checkpoint name, dtype, shape) of each tensor `checkpoint_weights` yields for parameters laid out as `layout`
    ((in-memory name, dtype, full shape), in the order they will be given), computed on meta tensors."""
    if not _conversions(model):
        return layout
    out = []
    for name, dtype, shape in layout:
        meta = torch.empty(
            shape, dtype=dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype), device="meta"
        )
        out.extend((new, dtype, list(t.shape)) for new, t in _revert(model, name, meta).items())
    return out


def checkpoint_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Any]]:
    """`weights` ((in-memory name, tensor) of `model`) under checkpoint names, each parameter's pieces yielded before
    the next parameter is asked for (the stream stays collective and one gather at a time under ZeRO-3)."""
    if not _conversions(model):
        yield from weights
        return
    for name, tensor in weights:
        yield from _revert(model, name, tensor).items()
