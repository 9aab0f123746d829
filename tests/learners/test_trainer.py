"""The DeepSpeed trainer in-process on the tiny model (1 rank, gloo): ZeRO stages, micro-batch equivalence, the
loss it reports against an independent computation, the critic and the reference model.

"The same step" is checked on what the claim is about, the gradient of the global batch (captured after the last
micro-batch's backward, before the optimizer steps), and then on the AdamW update where that update is well
conditioned. Comparing whole post-Adam weights is not a float32 property: the first AdamW step moves a weight by
lr * g / (|g| + eps_adam), so wherever |g| ~ eps_adam = 1e-8 (most rows of the tied embedding) a last-bit change
in g moves the step by up to lr (5.5% of lr was seen on an AMD EPYC, 0.5% on an Intel Xeon).

GRADIENT_TOLERANCE: max |g - g_ref| <= 64 eps_f32 * max |g_ref|, per tensor. Micro-batches, ZeRO's flat buffers
and recomputation leave the math alone and change only the order of float32 sums: the accumulation over
micro-batches, the sum over the batch's <= 112 token positions in every weight's gradient, and the blocking of the
matmuls (hidden 64, MLP 128) whose row count is the micro-batch's token count. Reordering a sum of n terms moves it
by ~sqrt(n) eps_f32 of its scale (n eps_f32 in the worst case); with n <= 128 that is ~11 eps per reduction, and a
gradient entry goes through a few of them in series (forward and backward of 2 layers): 64 eps_f32 = 7.6e-6
relative. Measured on an Intel Xeon: <= 3.1 eps_f32 (ZeRO-3, micro-batches of 1). One micro-batch weighted 1%
wrong moves the gradient by 1.2e-2 relative, 1500x over the bound
(test_the_gradient_bound_catches_a_micro_batch_weighted_one_percent_wrong asserts > 10x).

UPDATE_TOLERANCE: where the clipped gradient |g| >= 1000 eps_adam, |delta W - delta W_ref| <= eps_f32 |W| + 1e-3 lr.
For x, y of one sign x / (|x| + e) - y / (|y| + e) = e (x - y) / ((|x| + e)(|y| + e)), so a gradient error
|dg| <= |g| / 2 (the gradient bound gives |dg| < 1e-6 here) moves the step by at most lr eps_adam / |g| <= 1e-3 lr
there; AdamW's own arithmetic adds a few ulps of lr, and storing W + delta rounds to half an ulp of W in each run
(eps_f32 |W| for the two). A step that is wrong (another lr, a lost or
doubled micro-batch, a shard applied to the wrong weights) is off by ~lr.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from learners.trainer import Trainer
from tests.learners.learner_fakes import learner_config, synthetic_batch

LR = 1e-3
EPS_F32 = torch.finfo(torch.float32).eps  # 1.19e-7
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, the optimizer learners/engine.py builds
GRAD_CLIP = 1.0  # learner.grad_clip's default, which learner_config keeps
GRADIENT_TOLERANCE = 64 * EPS_F32  # relative to each tensor's max |g_ref|: see the module docstring
WELL_CONDITIONED = 1e3 * ADAM_EPS  # |clipped g| from which the AdamW step is insensitive to rounding in g
UPDATE_TOLERANCE = 1e-3 * LR  # + eps_f32 |W|, on the well-conditioned weights: see the module docstring

pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def batch() -> tuple[list, list]:
    groups = synthetic_batch(0, 2, 4)
    return groups, [np.zeros(g.size, dtype=np.int32) for g in groups]


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().float().clone() for name, tensor in trainer.full_weights()}


@dataclass
class Step:
    """One optimizer step of a fresh trainer on `batch`, observed from outside."""

    before: dict[str, torch.Tensor]  # the weights before the step
    gradients: dict[str, torch.Tensor]  # d loss / d W of the global batch (all micro-batches), before clipping
    update: dict[str, torch.Tensor]  # the weights after the step - before
    stats: dict[str, float]
    trainer: Trainer


def one_step(model_dir, dist, batch, first_micro_batch_weight: float = 1.0, **overrides) -> Step:
    """`first_micro_batch_weight` scales the first micro-batch's loss (a deliberately wrong weighting)."""
    from deepspeed.utils import safe_get_full_grad

    trainer = Trainer.from_config(learner_config(model_dir, **overrides), dist)
    policy, gradients, micro_batches = trainer.policy, {}, []
    backward, step = policy.backward, policy.step

    def weighted_backward(loss: torch.Tensor) -> None:
        backward(loss * (first_micro_batch_weight if not micro_batches else 1.0))
        micro_batches.append(loss)

    def capture_then_step() -> None:
        if policy.engine.is_gradient_accumulation_boundary():  # the last backward is done, the optimizer is next
            for name, param in policy.module.named_parameters():
                gradients[name] = safe_get_full_grad(param).detach().float().clone()
        step()

    policy.backward, policy.step = weighted_backward, capture_then_step
    before = weights(trainer)
    stats = trainer.train_step(*batch)
    after = weights(trainer)
    assert len(micro_batches) == trainer.micro_steps and gradients.keys() == before.keys()
    return Step(before, gradients, {name: after[name] - before[name] for name in before}, stats, trainer)


def gradient_error(step: Step, reference: Step) -> tuple[float, str]:
    """(max over tensors of max |g - g_ref| / max |g_ref|, that tensor's name)."""
    assert step.gradients.keys() == reference.gradients.keys()
    return max(
        (float((g - reference.gradients[name]).abs().max() / reference.gradients[name].abs().max()), name)
        for name, g in step.gradients.items()
    )


def update_excess(step: Step, reference: Step) -> float:
    """max of |delta W - delta W_ref| - eps_f32 |W| - UPDATE_TOLERANCE over the weights whose clipped gradient
    is >= WELL_CONDITIONED (<= 0: within the bound)."""
    norm = sum(float((g.double() ** 2).sum()) for g in reference.gradients.values()) ** 0.5
    clip = min(1.0, GRAD_CLIP / (norm + 1e-6))  # DeepSpeed's clip coefficient
    excess = -float("inf")
    for name, g in reference.gradients.items():
        where = clip * g.abs() >= WELL_CONDITIONED
        slack = (step.update[name] - reference.update[name]).abs() - EPS_F32 * reference.before[name].abs()
        if where.any():
            excess = max(excess, float(slack[where].max()) - UPDATE_TOLERANCE)
    return excess


def assert_same_step(step: Step, reference: Step) -> None:
    error, where = gradient_error(step, reference)
    assert error <= GRADIENT_TOLERANCE, f"max |g - g_ref| = {error / EPS_F32:.1f} eps_f32 x max |g_ref| over {where}"
    assert update_excess(step, reference) <= 0
    assert step.trainer.policy.optimizer_steps == 1


@pytest.fixture(scope="module")
def reference_step(tiny_model_dir, dist, batch) -> Step:
    """Stage 0, fp32, micro-batches of 4: the step every other configuration must reproduce."""
    reference = one_step(tiny_model_dir, dist, batch, learner__zero_stage=0)
    assert max(float(d.abs().max()) for d in reference.update.values()) == pytest.approx(LR, rel=0.01)  # it moved
    assert all(float(g.abs().max()) > 0 for g in reference.gradients.values())
    # the update check covers most weights: all but the embedding rows of tokens absent from the batch
    norm = sum(float((g.double() ** 2).sum()) for g in reference.gradients.values()) ** 0.5
    clip = min(1.0, GRAD_CLIP / (norm + 1e-6))
    for name, g in reference.gradients.items():
        if "embed" not in name:
            assert float((clip * g.abs() >= WELL_CONDITIONED).float().mean()) > 0.5, name
    return reference


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_give_the_same_update_as_stage_0(tiny_model_dir, dist, batch, reference_step, stage) -> None:
    assert_same_step(one_step(tiny_model_dir, dist, batch, learner__zero_stage=stage), reference_step)


@pytest.mark.parametrize("micro_batch_size", [1, 3, 8])
def test_micro_batches_add_up_to_one_step_on_the_global_batch(
    tiny_model_dir, dist, batch, reference_step, micro_batch_size
) -> None:
    step = one_step(tiny_model_dir, dist, batch, learner__zero_stage=0, learner__micro_batch_size=micro_batch_size)
    assert step.trainer.micro_steps == -(-8 // micro_batch_size)
    assert_same_step(step, reference_step)


def test_the_gradient_bound_catches_a_micro_batch_weighted_one_percent_wrong(
    tiny_model_dir, dist, batch, reference_step
) -> None:
    step = one_step(tiny_model_dir, dist, batch, first_micro_batch_weight=1.01, learner__zero_stage=0)
    error, _ = gradient_error(step, reference_step)
    assert error > 10 * GRADIENT_TOLERANCE


@pytest.mark.parametrize("stage", [0, 3])  # 3: gpu_cluster.toml's learner (review finding 15)
def test_gradient_checkpointing_gives_the_same_update(tiny_model_dir, dist, batch, reference_step, stage) -> None:
    step = one_step(
        tiny_model_dir,
        dist,
        batch,
        learner__zero_stage=stage,
        learner__gradient_checkpointing=True,
        algo__estimator="grpo",
    )
    assert_same_step(step, reference_step)


def test_the_attention_kernel_is_the_configured_one(tiny_model_dir, dist, batch) -> None:
    """learner.attn_implementation reaches the policy and the reference (review finding 12: flash-attention, and
    with it packing's one-row varlen layout, could not be chosen)."""
    trainer = one_step(
        tiny_model_dir, dist, batch, learner__zero_stage=0, learner__attn_implementation="eager", algo__kl_coef=0.1
    ).trainer
    assert trainer.policy.module.config._attn_implementation == "eager"
    assert trainer.reference.config._attn_implementation == "eager"
    assert not trainer.one_row  # the varlen layout is flash's only


def test_the_process_group_compiles_nothing_on_a_cpu(dist) -> None:
    """init_distributed on a CPU leaves DeepSpeed's shared-memory op unbuilt (learners.engine.skip_cpu_shm_op): it
    serves only DeepSpeed's tensor-parallel inference, and building it took ~40 s at every new venv and could leave a
    lock that stalled later learners. (Training's all-reduce over two gloo ranks, which does not use the op, is
    tests/learners/test_data_parallel.py's: one rank here reduces nothing.)"""
    import deepspeed.comm

    backend = deepspeed.comm.comm.cdb
    assert backend is not None and backend.shm_comm_op is None


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_train_in_bfloat16(tiny_model_dir, dist, batch, stage) -> None:
    step = one_step(tiny_model_dir, dist, batch, learner__zero_stage=stage, model__dtype="bfloat16")
    update, stats, trainer = step.update, step.stats, step.trainer
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
    from learners.logprobs import logprobs_from_logits
    from learners.losses import policy_loss

    temperature = 0.7
    stats = one_step(
        tiny_model_dir,
        dist,
        batch,
        learner__micro_batch_size=3,
        generator__temperature=temperature,
        algo__correction="tis",
        algo__tis_cap=1.5,
    ).stats
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
    # abs=1e-5, ~80 eps_f32 of these O(1) quantities (|loss| ~ 7e-3, w = exp(lp - behaviour) in [0.5, 1.5]): the
    # two forwards (DeepSpeed micro-batches of 3 vs one transformers forward of the whole batch) differ only in the
    # order of float32 sums, which moves a log-prob ~ -11 by a few eps_f32 |log p| ~ 1e-6 and w by as much
    # relative (measured: 2e-10 on the loss, 1.1e-7 on iw_mean). A plumbing error (temperature, advantages,
    # behaviour log-probs, the cap) moves them by >= 1e-3.
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
    # the policy still IS the reference: k3 = expm1(d) - d ~ d^2 / 2 for the log-prob differences d that float32
    # rounding leaves between the two models' forwards (< 1e-4 even at 64 eps_f32 |log p|), so < 5e-9 << 1e-6
    assert first["policy/kl"] == pytest.approx(0.0, abs=1e-6)
    assert second["policy/kl"] > 1e-5 and second["loss/kl"] > 1e-5
    assert first["loss/value"] > second["loss/value"] > 0  # the critic learns the returns
    assert not torch.equal(trainer.critic.module.value_head.weight.detach(), head)
    for key in ("loss/policy", "policy/entropy", "policy/kl_behaviour", "critic/clip_frac", "policy/iw_max"):
        assert np.isfinite(second[key]), key


def test_overlong_mask_trains_as_if_the_truncated_group_had_no_loss(tiny_model_dir, dist, batch) -> None:
    """Group 1 (the second micro-batch, all 4 rows) cut at the limit: masked, it adds nothing to the gradient and
    leaves the denominators. Reference: the same batch with group 1's rewards all equal (advantages exactly 0, so no
    gradient from it either) but still counted. seq_mean divides by 4 rows against 8: the gradient is exactly x2
    (a power of two; the other terms are the same float32 sums in the same order), within GRADIENT_TOLERANCE."""
    from dataclasses import replace

    groups, staleness = batch
    stop = [replace(g, finish_reasons=["stop"] * g.size) for g in groups]  # synthetic groups say "length"
    cut = [replace(g, finish_reasons=["length"] * g.size) if i == 1 else g for i, g in enumerate(stop)]
    flat = [replace(g, rewards=np.full(g.size, 0.5, np.float32)) if i == 1 else g for i, g in enumerate(stop)]
    masked = one_step(tiny_model_dir, dist, (cut, staleness), algo__overlong="mask", algo__aggregation="seq_mean")
    reference = one_step(tiny_model_dir, dist, (flat, staleness), algo__aggregation="seq_mean")
    reference.gradients = {name: 2 * g for name, g in reference.gradients.items()}
    error, where = gradient_error(masked, reference)
    assert error <= GRADIENT_TOLERANCE, f"{error / EPS_F32:.1f} eps_f32 over {where}"
    assert masked.stats["rollout/truncated_share"] == 0.5 and reference.stats["rollout/truncated_share"] == 0.0
    assert masked.stats["reward/overlong_penalty"] == 0.0


def test_overlong_penalty_gives_an_equal_reward_group_its_signal(tiny_model_dir, dist, batch) -> None:
    """Every reward 1: no advantage, no gradient. With the penalty (L_max = generator.max_tokens = 6, L_cache = 3)
    a completion of n tokens gets -min(max(n - 3, 0), 3) / 3: lengths 2..6 give 0, 0, -1/3, -2/3, -1."""
    from dataclasses import replace

    groups, staleness = batch
    ones = [replace(g, rewards=np.ones(g.size, np.float32)) for g in groups]
    lengths = [int(n) for g in ones for n in np.diff(g.offsets)]
    expected = sum(-min(max(n - 3, 0), 3) / 3 for n in lengths) / len(lengths)
    assert expected < 0 and len(set(lengths)) > 1  # the batch has lengths inside the window, and differing ones
    kwargs = {"generator__max_tokens": 6, "algo__overlong_window": 3}
    plain = one_step(tiny_model_dir, dist, (ones, staleness), **kwargs)
    penalised = one_step(tiny_model_dir, dist, (ones, staleness), algo__overlong="penalty", **kwargs)
    assert all(float(g.abs().max()) == 0.0 for g in plain.gradients.values())
    assert max(float(g.abs().max()) for g in penalised.gradients.values()) > 0
    assert penalised.stats["reward/overlong_penalty"] == pytest.approx(expected, rel=1e-6)  # float32 sum of 8
    assert penalised.stats["reward/mean"] == 1.0  # the reported reward is the task's, before the penalty


def test_gspo_first_step_equals_the_token_ratio_step(tiny_model_dir, dist, batch) -> None:
    """Before the update pi_theta = pi_prox: every log-ratio is 0, so GSPO's s_i = 1 = r_t and (test_losses_gspo)
    the two ratios give the same loss and gradient, with sequence-level TIS in both; no sequence is clipped."""
    kwargs = {"algo__correction": "tis", "algo__tis_level": "sequence", "algo__aggregation": "seq_mean"}
    token = one_step(tiny_model_dir, dist, batch, **kwargs)
    gspo = one_step(tiny_model_dir, dist, batch, algo__ratio="sequence", **kwargs)
    error, where = gradient_error(gspo, token)
    assert error <= GRADIENT_TOLERANCE, f"{error / EPS_F32:.1f} eps_f32 over {where}"
    assert gspo.stats["loss/policy"] == pytest.approx(token.stats["loss/policy"], rel=1e-6)
    assert gspo.stats["policy/seq_clip_frac"] == 0.0 and "policy/seq_clip_frac" not in token.stats


@pytest.mark.parametrize("kind", ["cispo", "sapo"])
def test_cispo_and_sapo_first_step_is_ppos_step(tiny_model_dir, dist, batch, reference_step, kind: str) -> None:
    """At the first step r = 1, where CISPO's clipped weight and SAPO's gate are 1 (test_losses_cispo_sapo): the
    same gradient as PPO's, through the trainer's objective, with token-level TIS as in the reference step."""
    step = one_step(tiny_model_dir, dist, batch, learner__zero_stage=0, algo__policy_loss=kind)
    assert_same_step(step, reference_step)
    assert step.stats["policy/clip_frac"] == 0.0
    assert ("policy/sapo_gate_mean" in step.stats) == (kind == "sapo")
    if kind == "sapo":
        assert step.stats["policy/sapo_gate_mean"] == pytest.approx(1.0, abs=1e-6)  # 4 s (1 - s) at r = 1: exact
