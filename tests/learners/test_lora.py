"""LoRA on the DeepSpeed trainer (tiny model, 1 rank, gloo): what trains, the weights it publishes (merged and
adapter-only), the reference as the policy with its adapters off, and checkpoints (adapter + merged HF export).

LOGIT_TOLERANCE: the merged model computes x (W + s B A)^T where the peft model computes x W^T + s (x A^T) B^T:
the same products, summed in another order (over the hidden size 64 or the MLP's 128, and the rank 4). Reordering
a float32 sum of n terms moves it by ~sqrt(n) eps_f32 of its scale; a logit goes through 2 layers of such sums
in series, so 64 eps_f32 x max |logit| bounds it with room (measured: 2.9 eps_f32 on an Intel Xeon). A merge that
is wrong (another scale alpha / r, B A transposed, an adapter left out) moves logits by ~|s B A x|, which after one
step at lr 1e-3 is ~1e-3 relative: 8000x over the bound.

Where two computations are the same operations on the same numbers (peft's merge against ours, the reference
against the base model, a resumed step against an uninterrupted one), equality is exact: CPU kernels repeat
their arithmetic bit for bit for the same shapes and thread count.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from learners.checkpoint import CheckpointManager, LearnerState
from learners.models import load_policy, load_reference
from learners.trainer import Trainer
from tests.learners.learner_fakes import learner_config, synthetic_batch

EPS_F32 = torch.finfo(torch.float32).eps
LOGIT_TOLERANCE = 64 * EPS_F32  # x max |logit|: see the module docstring
RANK, ALPHA = 4, 8.0
TOKENS = torch.tensor([[5, 60, 700, 8000, 3, 44, 1000, 12, 9, 4000]])

pytestmark = pytest.mark.deepspeed


def batch(seed: int) -> tuple[list, list]:
    groups = synthetic_batch(seed, 2, 4)
    return groups, [np.zeros(g.size, dtype=np.int32) for g in groups]


def lora_config(model_dir, **overrides):
    values = {"learner__lora__rank": RANK, "learner__lora__alpha": ALPHA, "algo__kl_coef": 0.05, **overrides}
    return learner_config(model_dir, **values)


@pytest.fixture(scope="module")
def trained(tiny_model_dir, dist) -> Trainer:
    """PPO with a critic and a KL reference, LoRA (rank 4, every projection), ZeRO-1, after one step."""
    trainer = Trainer.from_config(lora_config(tiny_model_dir, algo__estimator="gae"), dist)
    trainer.train_step(*batch(0))
    return trainer


def logits(model, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits


def test_only_the_adapters_and_the_value_head_train(tiny_model_dir, trained) -> None:
    base = dict(load_policy(tiny_model_dir, torch.float32).named_parameters())
    trainable = [name for name, p in trained.policy.module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    for name, param in trained.policy.module.named_parameters():
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if plain in base:  # a frozen base weight: exactly as loaded
            assert torch.equal(param.detach(), base[plain].detach()), name
    moved = [float(p.detach().abs().max()) for n, p in trained.policy.module.named_parameters() if ".lora_B." in n]
    assert min(moved) > 0  # B starts at zero: every adapter took the step
    critic = [name for name, p in trained.critic.module.named_parameters() if p.requires_grad]
    assert {"value_head.weight", "value_head.bias"} <= set(critic)
    assert all(".lora_" in name for name in critic if not name.startswith("value_head."))


def test_merged_weights_are_peft_merge_and_the_model_it_computes(tiny_model_dir, trained) -> None:
    layout = trained.weight_layout()
    merged = {name: tensor.clone() for name, tensor in trained.full_weights()}
    plain = load_policy(tiny_model_dir, torch.float32)
    assert [name for name, _, _ in layout] == list(merged) == [name for name, _ in plain.named_parameters()]
    assert all(list(merged[name].shape) == shape and dtype == "float32" for name, dtype, shape in layout)
    peft_merge = copy.deepcopy(trained.policy.module).merge_and_unload().state_dict()
    for name, tensor in merged.items():
        assert torch.equal(tensor, peft_merge[name]), name
    plain.load_state_dict(merged, strict=False)  # the tied output layer is the embedding
    expected = logits(trained.policy.module)
    assert (logits(plain) - expected).abs().max() <= LOGIT_TOLERANCE * expected.abs().max()
    base = load_policy(tiny_model_dir, torch.float32).state_dict()
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )


def test_the_reference_is_the_base_model_with_the_adapters_off(tiny_model_dir, trained) -> None:
    base = logits(load_reference(tiny_model_dir, torch.float32))
    assert torch.equal(logits(trained.reference), base)
    assert not torch.equal(logits(trained.policy.module), base)  # the adapters are back on afterwards


def test_adapter_sync_publishes_the_a_and_b_matrices_by_the_contract_names(trained) -> None:
    from peft import get_peft_model_state_dict

    module = trained.policy.module
    expected = {
        name.removeprefix("base_model.model."): tensor for name, tensor in get_peft_model_state_dict(module).items()
    }
    trained.lora.sync = "adapter"
    try:
        layout, published = trained.weight_layout(), {name: t.clone() for name, t in trained.full_weights()}
    finally:
        trained.lora.sync = "merged"
    assert list(published) == [name for name, _, _ in layout] == list(expected)
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in published
    for name, dtype, shape in layout:
        assert torch.equal(published[name], expected[name]) and list(published[name].shape) == shape, name
        assert shape[0 if ".lora_A." in name else 1] == RANK and dtype == "float32"
    assert len(published) == 2 * 7 * 2  # A and B of 7 projections in 2 layers


def test_a_checkpoint_holds_the_adapter_and_a_merged_export_and_resumes(
    tiny_model_dir, dist, trained, tmp_path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = CheckpointManager(tmp_path, rank=0).save(trained, LearnerState(step=1, policy_version=1))
    at_save = logits(trained.policy.module)
    merged = {name: tensor.clone() for name, tensor in trained.full_weights()}
    exported = AutoModelForCausalLM.from_pretrained(path / "hf", dtype=torch.float32)
    assert all(torch.equal(exported.state_dict()[name], tensor) for name, tensor in merged.items())
    assert (logits(exported) - at_save).abs().max() <= LOGIT_TOLERANCE * at_save.abs().max()
    adapter = PeftModel.from_pretrained(load_policy(tiny_model_dir, torch.float32), path / "adapter")
    assert torch.equal(logits(adapter), at_save)
    saved = torch.load(path / "deepspeed" / "policy" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    # no frozen base weight but the tied output layer: DeepSpeed drops the frozen parameters by their
    # named_parameters names, and a tied weight is named there once (the embedding) but twice in the state dict
    assert {name for name in saved if ".lora_" not in name} == {"base_model.model.lm_head.weight"}

    uninterrupted = trained.train_step(*batch(1))
    expected = {name: p.detach().clone() for name, p in trained.policy.module.named_parameters()}
    resumed = Trainer.from_config(lora_config(tiny_model_dir, algo__estimator="gae"), dist)
    CheckpointManager(tmp_path, rank=0).load(path, resumed)
    assert torch.equal(logits(resumed.policy.module), at_save)  # the adapters came back
    stats = resumed.train_step(*batch(1))
    assert stats["loss/policy"] == uninterrupted["loss/policy"] and stats["loss/value"] == uninterrupted["loss/value"]
    for name, param in resumed.policy.module.named_parameters():  # the optimizer state continued (exact)
        assert torch.equal(param.detach(), expected[name]), name


def test_zero3_publishes_gathered_adapters_and_their_merge(tiny_model_dir, dist) -> None:
    trainer = Trainer.from_config(
        lora_config(tiny_model_dir, learner__zero_stage=3, learner__lora__sync="adapter", algo__kl_coef=0.0), dist
    )
    trainer.train_step(*batch(0))
    adapters = {name: tensor.clone() for name, tensor in trainer.full_weights()}
    assert [name for name, _, _ in trainer.weight_layout()] == list(adapters)
    assert all(list(adapters[name].shape) == shape for name, _, shape in trainer.weight_layout())
    assert min(float(t.abs().max()) for name, t in adapters.items() if ".lora_B." in name) > 0
    base = load_policy(tiny_model_dir, torch.float32).state_dict()
    scale = ALPHA / RANK
    for name, tensor in trainer._merged_weights():
        module = name.removesuffix(".weight")
        if f"{module}.lora_A.weight" in adapters:  # peft's delta: (B @ A) * scale, then added in W's dtype
            delta = (adapters[f"{module}.lora_B.weight"] @ adapters[f"{module}.lora_A.weight"]) * scale
            assert torch.equal(tensor, base[name] + delta), name
        else:
            assert torch.equal(tensor, base[name]), name
