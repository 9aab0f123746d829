"""[learner.lora] at config load, a target module the model lacks, and the adapter settings the publisher puts on
an adapter-only update's header (no DeepSpeed, no engine)."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import ConfigError, LoraConfig, load_config
from common.weights import check_adapter


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(None, list(overrides))
    return str(error.value)


def test_the_defaults_are_off_and_target_every_llama_projection() -> None:
    lora = load_config(None, ["--learner.lora.rank", "16"]).learner.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.sync) == (16, 16.0, 0.0, "merged")
    assert lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert load_config(None, []).learner.lora.rank == 0


def test_what_cannot_work_is_refused_at_load_naming_the_key() -> None:
    assert refusal("--learner.lora.sync", "adapter").startswith("--learner.lora.sync adapter: ")
    broadcast = refusal(
        "--learner.lora.rank=8",
        "--learner.lora.sync=adapter",
        "--weights.transport=broadcast",
    )
    assert "learner.lora.sync" in broadcast and "relay" in broadcast
    assert "'q.proj' is not a module name" in refusal("--learner.lora.target_modules", '["q.proj"]')
    assert "repeated" in refusal("--learner.lora.target_modules", '["q_proj", "q_proj"]')
    assert refusal("--learner.lora.rnk", "8") == "--learner.lora.rnk 8: unknown key; did you mean --learner.lora.rank?"
    assert refusal("--learner.lora.rank", "-1").startswith("--learner.lora.rank -1: ")
    assert refusal("--learner.lora.dropout", "1.0").startswith("--learner.lora.dropout 1.0: ")


def test_every_zero_stage_takes_a_lora_policy() -> None:
    # all four train with adapters on CPU (tests/learners/test_lora.py runs ZeRO-1 and ZeRO-3): none is refused
    for stage in (0, 1, 2, 3):
        load_config(None, ["--learner.lora.rank", "8", "--learner.zero_stage", str(stage)])


def test_a_target_module_the_model_lacks_is_refused_with_its_linear_layers(tiny_model_dir) -> None:
    import torch

    from learners.models import add_adapters, load_policy

    with pytest.raises(ValueError, match="learner.lora.target_modules") as error:
        add_adapters(load_policy(tiny_model_dir, torch.float32), LoraConfig(rank=4, target_modules=["q_proj", "qkv"]))
    assert "'qkv' match no linear layer" in str(error.value)
    assert "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head" in str(error.value)


def test_an_adapter_update_header_carries_the_adapter_settings() -> None:
    from learners.snapshot import copy_into_snapshot

    lora = LoraConfig(rank=2, alpha=4.0, target_modules=["q_proj"], sync="adapter")
    names = ["model.layers.0.self_attn.q_proj.lora_A.weight", "model.layers.0.self_attn.q_proj.lora_B.weight"]
    tensors = [np.ones((2, 8), np.float32), np.ones((8, 2), np.float32)]
    layout = [(name, "float32", list(t.shape)) for name, t in zip(names, tensors, strict=True)]
    header = copy_into_snapshot(3, layout, zip(names, tensors, strict=True), 1 << 20, adapter=lora).header
    assert (header.lora_rank, header.lora_alpha, header.lora_target_modules) == (2, 4.0, ["q_proj"])
    header.validate()
    check_adapter(header)  # what the generator checks (common.weights)
    full = copy_into_snapshot(3, layout, zip(names, tensors, strict=True), 1 << 20).header
    assert (full.lora_rank, full.lora_alpha, full.lora_target_modules) == (0, 0.0, [])
