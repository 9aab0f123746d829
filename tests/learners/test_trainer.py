"""The DeepSpeed trainer in-process on the tiny model (1 rank, gloo): ZeRO stages, micro-batch equivalence, the
loss it reports against an independent computation, the critic and the reference model.

Tolerance for "the same update": max |delta W - delta W_ref| <= 1% of lr. The first AdamW step moves each weight
by lr * g / (|g| + eps): float rounding of g (another summation order: micro-batches, ZeRO's flat buffers) changes
the step by ~1e-6 relative wherever |g| >> eps, and by up to lr only where |g| ~ eps = 1e-8. Measured here:
<= 5e-6 (0.5% of lr = 1e-3); an error in how micro-batches are weighted changes the gradient's direction and
shows up as ~lr.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learners.engine import init_distributed
from learners.trainer import Trainer
from tests.learners.learner_fakes import learner_config, synthetic_batch

LR = 1e-3
TOLERANCE = 1e-2 * LR

pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def dist():
    return init_distributed()


@pytest.fixture(scope="module")
def batch() -> tuple[list, list]:
    groups = synthetic_batch(0, 2, 4)
    return groups, [np.zeros(g.size, dtype=np.int32) for g in groups]


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().float().clone() for name, tensor in trainer.full_weights()}


def one_update(model_dir, dist, batch, **overrides) -> tuple[dict[str, torch.Tensor], dict[str, float], Trainer]:
    trainer = Trainer.from_config(learner_config(model_dir, **overrides), dist)
    before = weights(trainer)
    stats = trainer.train_step(*batch)
    after = weights(trainer)
    return {name: after[name] - before[name] for name in before}, stats, trainer


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[name] - b[name]).abs().max()) for name in a)


@pytest.fixture(scope="module")
def reference_update(tiny_model_dir, dist, batch) -> dict[str, torch.Tensor]:
    """Stage 0, fp32, micro-batches of 4: the update every other configuration must reproduce."""
    update, _stats, _ = one_update(tiny_model_dir, dist, batch, learner__zero_stage=0)
    assert max(float(d.abs().max()) for d in update.values()) == pytest.approx(LR, rel=0.01)  # it moved
    return update


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_give_the_same_update_as_stage_0(tiny_model_dir, dist, batch, reference_update, stage) -> None:
    update, _stats, trainer = one_update(tiny_model_dir, dist, batch, learner__zero_stage=stage)
    assert max_difference(update, reference_update) <= TOLERANCE
    assert trainer.policy.optimizer_steps == 1


@pytest.mark.parametrize("micro_batch_size", [1, 3, 8])
def test_micro_batches_add_up_to_one_step_on_the_global_batch(
    tiny_model_dir, dist, batch, reference_update, micro_batch_size
) -> None:
    update, _, trainer = one_update(
        tiny_model_dir, dist, batch, learner__zero_stage=0, learner__micro_batch_size=micro_batch_size
    )
    assert trainer.micro_steps == -(-8 // micro_batch_size)
    assert max_difference(update, reference_update) <= TOLERANCE


def test_gradient_checkpointing_gives_the_same_update(tiny_model_dir, dist, batch, reference_update) -> None:
    update, _, _ = one_update(
        tiny_model_dir, dist, batch, learner__zero_stage=0, learner__gradient_checkpointing=True, algo__estimator="grpo"
    )
    assert max_difference(update, reference_update) <= TOLERANCE


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_train_in_bfloat16(tiny_model_dir, dist, batch, stage) -> None:
    update, stats, trainer = one_update(tiny_model_dir, dist, batch, learner__zero_stage=stage, model__dtype="bfloat16")
    assert {dtype for _, dtype, _ in trainer.weight_layout()} == {"bfloat16"}
    assert all(torch.isfinite(d).all() for d in update.values())
    moved = sum(int((d != 0).sum()) for d in update.values())
    assert moved > 0.5 * sum(d.numel() for name, d in update.items() if "embed" not in name)
    assert np.isfinite(stats["loss/policy"]) and stats["perf/tokens"] > 0


def test_reported_loss_is_the_policy_loss_of_the_whole_batch(tiny_model_dir, dist, batch) -> None:
    """Recompute the first step's loss with plain transformers on the unsplit batch: advantages, temperature,
    behaviour log-probs and the TIS correction all have to be plumbed right for the numbers to agree."""
    from transformers import AutoModelForCausalLM

    from learners.advantages import broadcast_to_tokens, grpo_advantages
    from learners.batching import pad_groups
    from learners.losses import logprobs_from_logits, policy_loss

    temperature = 0.7
    _, stats, _ = one_update(
        tiny_model_dir,
        dist,
        batch,
        learner__micro_batch_size=3,
        generator__temperature=temperature,
        algo__correction="tis",
        algo__tis_cap=1.5,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    padded = pad_groups(*batch, pad_id=2)
    inputs = padded.model_inputs(slice(0, padded.size), torch.device("cpu"))
    with torch.no_grad():
        logits = model(**inputs.forward_kwargs(), logits_to_keep=inputs.num_predicted).logits[:, :-1] / temperature
        logprobs = logprobs_from_logits(logits, inputs.completion_tokens)
    advantages = broadcast_to_tokens(grpo_advantages(padded.rewards, padded.group_ids), inputs.loss_mask)
    loss, parts = policy_loss(
        logprobs,
        logprobs,
        inputs.behaviour_logprobs,
        advantages,
        inputs.loss_mask,
        clip_low=0.2,
        clip_high=0.28,
        correction="tis",
        tis_cap=1.5,
    )
    assert stats["loss/policy"] == pytest.approx(float(loss), abs=1e-5)
    assert stats["policy/iw_mean"] == pytest.approx(float(parts["is_weight_mean"]), abs=1e-5)
    assert stats["policy/iw_max"] == pytest.approx(min(float(parts["is_weight_max"]), 1.5), abs=1e-5)
    assert stats["policy/clip_frac"] == 0.0  # proximal = current before the update: the ratio is 1


def test_gae_trains_the_critic_and_the_kl_grows_from_zero(tiny_model_dir, dist, batch) -> None:
    trainer = Trainer.from_config(
        learner_config(tiny_model_dir, algo__estimator="gae", algo__kl_coef=0.1, learner__critic_lr=1e-2), dist
    )
    head = trainer.critic.module.value_head.weight.detach().clone()
    first = trainer.train_step(*batch)
    second = trainer.train_step(*batch)
    assert first["policy/kl"] == pytest.approx(0.0, abs=1e-6)  # the policy still IS the reference
    assert second["policy/kl"] > 1e-5 and second["loss/kl"] > 1e-5
    assert first["loss/value"] > second["loss/value"] > 0  # the critic learns the returns
    assert not torch.equal(trainer.critic.module.value_head.weight.detach(), head)
    for key in ("loss/policy", "policy/entropy", "policy/kl_behaviour", "critic/clip_frac", "policy/iw_max"):
        assert np.isfinite(second[key]), key
