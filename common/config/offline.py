"""`[sft]`, `[rm]`, `[dpo]`: the offline stages (`tandem sft`, `tandem rm`, `tandem dpo`)."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from common.config.base import MAX_ARITHMETIC_PROMPTS, _Section


class _OfflineStage(_Section):
    """Data and schedule of an offline stage (`tandem sft`, `tandem rm`, `tandem dpo`, learners/offline/loop.py).
    The stages train with [learner]'s engine settings (lr, zero_stage, world_size, micro_batch_size, grad_clip,
    warmup_steps, weight_decay, gradient_checkpointing, save_every, resume, cpu_cores); learner.total_steps is
    not used: `epochs` and `max_steps` decide."""

    source: str = Field(
        "arithmetic",
        description="`arithmetic`: rows built from the embedded task (common.rlhf_data); else a .jsonl or .parquet "
        "file or a `datasets` folder of rows (docs/rlhf.md shows their shapes).",
        min_length=1,
    )
    eval_source: str = Field(
        "",
        description="Held-out rows, a file like `source`. Empty: the held-out split of `arithmetic` (prompts whose "
        "expressions training never sees), or the last `held_out` share of a file source.",
    )
    held_out: float = Field(
        0.1, description="Share of a file source's rows kept out for evaluation (eval_source empty).", ge=0, lt=1
    )
    num_examples: int = Field(
        512, description="source = arithmetic: training rows built.", ge=1, le=MAX_ARITHMETIC_PROMPTS
    )
    num_eval_examples: int = Field(
        128, description="Held-out rows evaluated, at most (source = arithmetic: built).", ge=1, le=100_000
    )
    difficulty: int = Field(1, description="source = arithmetic: the difficulty level (see common.tasks).", ge=1, le=5)
    batch_size: int = Field(
        16,
        description="Rows (chats or pairs) in one optimizer step, over all ranks: a multiple of learner.world_size.",
        ge=1,
    )
    epochs: float = Field(1.0, description="Passes over the training rows (fractions allowed).", gt=0, le=1e6)
    max_steps: int = Field(0, description="Optimizer steps at most (0 = as many as `epochs` makes).", ge=0)
    eval_every: int = Field(
        0, description="Evaluate on the held-out rows every this many steps (0 = at the start and the end only).", ge=0
    )
    prompt_key: str = Field("prompt", description="Column of a row's prompt as text.", min_length=1)
    messages_key: str = Field("messages", description="Column of a row's prompt (or chat) as messages.", min_length=1)


class SftConfig(_OfflineStage):
    """`tandem sft`: supervised fine-tuning on chats; the loss covers the assistant's tokens only. A row holds
    `messages` (a chat), or `prompt` and `completion` (text)."""

    completion_key: str = Field("completion", description="Column of the reply when a row has `prompt`.")


class RmConfig(_OfflineStage):
    """`tandem rm`: a reward model (the policy's architecture with a scalar head) trained on preference pairs with
    the Bradley-Terry loss. A row holds `prompt` (text) or `messages` (a chat), and `chosen` and `rejected`
    (text, or assistant messages; a whole chat each when the row has no prompt)."""

    chosen_key: str = Field("chosen", description="Column of the preferred reply.", min_length=1)
    rejected_key: str = Field("rejected", description="Column of the other reply.", min_length=1)
    margin: float = Field(
        0.0,
        description="Margin m of the loss -log sigmoid(r_chosen - r_rejected - m): the chosen reply must win by m.",
        ge=0,
    )


class DpoConfig(RmConfig):
    """`tandem dpo`: direct preference optimisation of the policy against a frozen reference, on the rows of
    `tandem rm`."""

    beta: float = Field(0.1, description="Strength of the implicit KL to the reference (beta).", gt=0)
    loss: Literal["sigmoid", "ipo"] = Field(
        "sigmoid", description="`sigmoid`: DPO's loss; `ipo`: IPO's squared loss ((h - 1/(2 beta))^2)."
    )
    label_smoothing: float = Field(
        0.0,
        description="cDPO: the share of pairs taken as mislabelled (loss = (1-e) DPO(chosen) + e DPO(swapped)); "
        "sigmoid loss only.",
        ge=0,
        lt=0.5,
    )
    reference: str = Field(
        "", description="The frozen reference model (a model.path value); empty = model.path, the starting point."
    )

    @model_validator(mode="after")
    def _smoothing_needs_sigmoid(self) -> DpoConfig:
        if self.label_smoothing and self.loss != "sigmoid":
            raise ValueError("label_smoothing: only with loss = 'sigmoid' (IPO has no smoothed form here)")
        return self
