"""The learner's modules, built from one Hugging Face directory: the policy, the frozen reference, the critic.

    policy = load_policy(model_dir, torch.bfloat16)                 # AutoModelForCausalLM, trainable
    reference = load_reference(model_dir, torch.bfloat16)           # same weights, frozen, eval mode
    critic = ValueModel.from_pretrained(model_dir, torch.bfloat16)  # the policy's backbone + a scalar head

Parameter names are the Hugging Face state-dict names (`model.layers.0.self_attn.q_proj.weight`, ...): what
`save_pretrained` writes and what vLLM's `load_weights` expects. No DeepSpeed here (see `learners.engine`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    """`model.dtype` as a torch dtype; raises ValueError naming the allowed values."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"model.dtype: must be one of {sorted(DTYPES)} (got {name!r})") from None


def _check_model_dir(model_dir: Path) -> None:
    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_dir}: not a Hugging Face model directory (no config.json); set model.path to 'smollm2', "
            "'tiny' or a local directory made by save_pretrained"
        )


def load_policy(model_dir: Path, dtype: torch.dtype, gradient_checkpointing: bool = False) -> nn.Module:
    """The trainable causal LM (train mode, every parameter requires grad)."""
    from transformers import AutoModelForCausalLM

    _check_model_dir(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def load_reference(model_dir: Path, dtype: torch.dtype) -> nn.Module:
    """The frozen reference policy for the KL term: the initial weights, eval mode, no gradients.

    A full replica on every rank (no optimizer state, so it costs the weights only: 270 MB for SmolLM2 in bf16).
    """
    from transformers import AutoModelForCausalLM

    _check_model_dir(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)
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
    def from_pretrained(cls, model_dir: Path, dtype: torch.dtype, gradient_checkpointing: bool = False) -> ValueModel:
        """The critic from a causal LM directory (its backbone, a zero head) or from a reward model directory (a
        sequence-classification model with one label, e.g. `tandem rm`'s export: its backbone and its scalar head,
        so the first values are the reward model's scores of each prefix, as OpenRLHF starts its critic)."""
        from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

        _check_model_dir(model_dir)
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        head = None
        if is_reward_model(config):
            scorer = AutoModelForSequenceClassification.from_pretrained(
                str(model_dir), dtype=dtype, local_files_only=True
            )
            backbone, head = getattr(scorer, scorer.base_model_prefix), getattr(scorer, "score", None)
            if not isinstance(head, nn.Linear) or head.out_features != 1:
                raise ValueError(f"{model_dir}: a reward model whose head is not a `score` linear layer to one label")
        else:
            backbone = AutoModel.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)
        backbone.config.use_cache = False
        if gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = cls(backbone, backbone.config.hidden_size)
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
