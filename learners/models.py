"""The learner's modules, built from one Hugging Face directory: the policy, the frozen reference, the critic.

    policy = load_policy(model_dir, torch.bfloat16)                 # AutoModelForCausalLM, trainable
    reference = load_reference(model_dir, torch.bfloat16)           # same weights, frozen, eval mode
    critic = ValueModel.from_pretrained(model_dir, torch.bfloat16)  # the policy's backbone + a scalar head

Parameter names are the Hugging Face state-dict names (`model.layers.0.self_attn.q_proj.weight`, ...): what
`save_pretrained` writes and what vLLM's `load_weights` expects. No DeepSpeed here (see `learners.engine`).

LoRA ([learner.lora], peft, the `lora` extra):

    policy = add_adapters(load_policy(model_dir, torch.bfloat16), lora)     # a peft PeftModel: only A, B train
    reference = AdaptersOff(policy)                                          # the same modules, adapters disabled
    for name, tensor in merged_weights(policy): ...                          # HF names, W + (alpha / r) B A
    for name, tensor in adapter_weights(policy): ...                         # model.layers.0...q_proj.lora_A.weight

With adapters the frozen reference is no second copy: the base weights never train, so the policy with its
adapters disabled (peft's `disable_adapter()`: each adapted layer returns its base layer's output alone) computes
exactly what the initial model computes, bit for bit. A target module that names no linear layer of the model is
refused by `add_adapters` with a ValueError that lists the model's linear layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.config import LoraConfig
from common.dtypes import choose_dtype

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    """A resolved `model.dtype` (`training_dtype`) as a torch dtype; raises ValueError naming the allowed values."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"model.dtype: must be one of {sorted(DTYPES)} (got {name!r})") from None


def training_dtype(requested: str, device: torch.device) -> str:
    """`model.dtype` resolved for a learner computing on `device` (`common.dtypes`: `auto` is bfloat16 on a CUDA
    device of compute capability >= 8.0 or a CPU with amx_bf16, else float32), logged with its reason;
    bfloat16 on a CPU that emulates it is warned about once."""
    cuda_bf16 = torch.cuda.is_bf16_supported(including_emulation=False) if device.type == "cuda" else None
    return choose_dtype(requested, cuda_bf16).dtype


def _check_model_dir(model_dir: Path) -> None:
    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_dir}: not a Hugging Face model directory (no config.json); set model.path to 'smollm2', "
            "'tiny' or a local directory made by save_pretrained"
        )


def load_policy(
    model_dir: Path, dtype: torch.dtype, gradient_checkpointing: bool = False, attention: str = "sdpa"
) -> nn.Module:
    """The trainable causal LM (train mode, every parameter requires grad). `attention`: transformers'
    attn_implementation (learner.attn_implementation)."""
    from transformers import AutoModelForCausalLM

    _check_model_dir(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, local_files_only=True, attn_implementation=attention
    )
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def load_reference(model_dir: Path, dtype: torch.dtype, attention: str = "sdpa") -> nn.Module:
    """The frozen reference policy for the KL term: the initial weights, eval mode, no gradients.

    A full replica on every rank (no optimizer state, so it costs the weights only: 270 MB for SmolLM2 in bf16).
    """
    from transformers import AutoModelForCausalLM

    _check_model_dir(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, local_files_only=True, attn_implementation=attention
    )
    model.config.use_cache = False
    model.requires_grad_(False)
    model.eval()
    return model


def is_reward_model(config: object) -> bool:
    """Whether a Hugging Face config describes a reward model: a `...ForSequenceClassification` with one label."""
    architectures = getattr(config, "architectures", None) or []
    return any(name.endswith("ForSequenceClassification") for name in architectures) and config.num_labels == 1


class ValueModel(nn.Module):
    """A critic: the policy's transformer backbone (initialised from the same weights) and a linear value head.

    `forward(..., values_to_keep=k)` returns the values of the last k positions [B, k] (like `logits_to_keep`),
    so the caller can take V(s_t) for completion token t at the position that predicts it.
    The head starts at zero (V = 0 everywhere), so the first advantages are the plain returns.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1, dtype=next(backbone.parameters()).dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(
        cls,
        model_dir: Path,
        dtype: torch.dtype,
        gradient_checkpointing: bool = False,
        lora: LoraConfig | None = None,
        attention: str = "sdpa",
    ) -> ValueModel:
        """The critic from a causal LM directory (its backbone, a zero head) or from a reward model directory (a
        sequence-classification model with one label, e.g. `tandem rm`'s export: its backbone and its scalar head,
        so the first values are the reward model's scores of each prefix, as OpenRLHF starts its critic).
        `lora`: adapters on the backbone (`add_adapters`); the value head stays fully trainable."""
        from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

        _check_model_dir(model_dir)
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        head = None
        if is_reward_model(config):
            scorer = AutoModelForSequenceClassification.from_pretrained(
                str(model_dir), dtype=dtype, local_files_only=True, attn_implementation=attention
            )
            backbone, head = getattr(scorer, scorer.base_model_prefix), getattr(scorer, "score", None)
            if not isinstance(head, nn.Linear) or head.out_features != 1:
                raise ValueError(f"{model_dir}: a reward model whose head is not a `score` linear layer to one label")
        else:
            backbone = AutoModel.from_pretrained(
                str(model_dir), dtype=dtype, local_files_only=True, attn_implementation=attention
            )
        backbone.config.use_cache = False
        if gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = cls(add_adapters(backbone, lora) if lora else backbone, backbone.config.hidden_size)
        if head is not None:
            with torch.no_grad():
                model.value_head.weight.copy_(head.weight)
                if head.bias is not None:
                    model.value_head.bias.copy_(head.bias)
        model.train()
        return model

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, values_to_keep: int
    ) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # [B, L, H]
        return self.value_head(hidden[:, -values_to_keep:]).squeeze(-1).float()  # [B, k]


# ---------------------------------------------------------------------------------------------------- LoRA
ADAPTER = "default"  # peft's name of the one adapter a model gets here
PEFT_PREFIX = "base_model.model."  # what peft puts before the wrapped model's own parameter names


def linear_layer_names(model: nn.Module) -> list[str]:
    """The distinct last parts of the names of the model's linear layers (`q_proj`, ..., `lm_head`), in order."""
    names = [name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    return list(dict.fromkeys(names))


def add_adapters(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """`model` with LoRA adapters of `lora` (rank > 0) on every linear layer whose name ends in one of
    `lora.target_modules`: a peft `PeftModel` in which only the adapters require grad (A random, B zero, so it
    starts as `model`). `model` itself is changed (peft injects the adapter layers into it).

    Raises ValueError naming learner.lora.target_modules when a target matches no linear layer (with the list of
    the model's linear layers), and ImportError saying how to install peft when it is missing."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError:
        raise ImportError(
            "learner.lora needs peft: pip install 'tandem-rl[lora]' (scripts/setup.sh installs it)"
        ) from None
    linear = linear_layer_names(model)
    missing = [name for name in lora.target_modules if name not in linear]
    if missing:
        raise ValueError(
            f"learner.lora.target_modules: {', '.join(map(repr, missing))} match no linear layer of this model; "
            f"its linear layers are: {', '.join(linear)}"
        )
    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
    )
    return get_peft_model(model, config, adapter_name=ADAPTER)


def has_adapters(model: nn.Module) -> bool:
    """Whether `model` is a peft model (adapters added by `add_adapters`)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


class AdaptersOff:
    """The frozen reference of a LoRA policy: the policy's own modules called with the adapters disabled (no copy).

    `forward` is the policy engine's (or module's) call: under ZeRO-3 its parameters are gathered by the engine's
    hooks as for any forward. Call it under `torch.no_grad()` (the reference never trains). `get_output_embeddings`
    gives the output layer where its weight may be used outside a forward (None under ZeRO-3: partitioned), and
    `config` the model's config, so callers treat it as they treat a plain reference model."""

    def __init__(self, peft_model: nn.Module, forward: Any = None, zero3: bool = False) -> None:
        self.peft_model, self.forward, self.zero3 = peft_model, forward or peft_model, zero3

    def __call__(self, **inputs: Any) -> Any:
        with self.peft_model.disable_adapter():
            return self.forward(**inputs)

    @property
    def config(self) -> Any:
        return self.peft_model.config

    def get_output_embeddings(self) -> nn.Module | None:
        return None if self.zero3 else self.peft_model.get_output_embeddings()


def _adapted_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Name (without peft's prefix) -> peft LoRA layer, for every adapted layer of `model`."""
    return {
        name.removeprefix(PEFT_PREFIX): module
        for name, module in model.named_modules()
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")
    }


def _gathered(params: list[nn.Parameter], zero3: bool) -> Any:
    """Under ZeRO-3 the full `params` for the duration of the context (a collective), else nothing to do."""
    if not zero3:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def merged_layout(model: nn.Module) -> list[tuple[str, torch.dtype, list[int]]]:
    """(HF name, dtype, full shape) of each tensor `merged_weights` yields, in its order, without a gather."""
    return [
        (hf, param.dtype, list(getattr(param, "ds_shape", param.shape)))
        for name, param in model.named_parameters()
        if (hf := _merged_name(name)) is not None
    ]


def _merged_name(name: str) -> str | None:
    """The HF name of a peft parameter in the merged model (None for an adapter matrix)."""
    if ".lora_A." in name or ".lora_B." in name:
        return None
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def merged_weights(model: nn.Module, zero3: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The full weights of the merged model under the plain HF names (no `base_model.model.`, no `.base_layer`),
    in the base model's `named_parameters` order (tied weights once): each adapted weight W becomes
    W + (alpha / r) B A, computed as peft's own merge computes it (`get_delta_weight`, then the sum in W's dtype),
    so the tensors equal `merge_and_unload()`'s, bit for bit. Nothing is merged in place: the adapters keep
    training. Collective under ZeRO-3 (every rank must exhaust the iterator); a yielded tensor is valid until the
    next one is requested."""
    layers = _adapted_layers(model)
    for name, param in model.named_parameters():
        hf = _merged_name(name)
        if hf is None:
            continue
        path, _, leaf = name.removeprefix(PEFT_PREFIX).rpartition(".")
        layer = layers.get(path.removesuffix(".base_layer")) if path.endswith(".base_layer") else None
        if layer is None or leaf != "weight":
            with _gathered([param], zero3):
                yield hf, param.detach()
            continue
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        with _gathered([param, a, b], zero3), torch.no_grad():
            yield hf, param.detach() + layer.get_delta_weight(ADAPTER).to(param.dtype)


def adapter_layout(model: nn.Module) -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, dtype, full shape) of each tensor `adapter_weights` yields, in its order, without a gather."""
    return [
        (adapter, param.dtype, list(getattr(param, "ds_shape", param.shape)))
        for name, param in model.named_parameters()
        if (adapter := _adapter_name(name)) is not None
    ]


def _adapter_name(name: str) -> str | None:
    """The contract's name of an adapter matrix (peft's `get_peft_model_state_dict` name without
    `base_model.model.`: `model.layers.0.self_attn.q_proj.lora_A.weight`), None for any other parameter."""
    if ".lora_A." not in name and ".lora_B." not in name:
        return None
    return name.removeprefix(PEFT_PREFIX).replace(f".{ADAPTER}.", ".")


def adapter_weights(model: nn.Module, zero3: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The LoRA A [r, in] and B [out, r] matrices by the contract's names (see `_adapter_name`), in
    `named_parameters` order, in the training dtype. Collective under ZeRO-3, as `merged_weights`."""
    for name, param in model.named_parameters():
        adapter = _adapter_name(name)
        if adapter is not None:
            with _gathered([param], zero3):
                yield adapter, param.detach()
