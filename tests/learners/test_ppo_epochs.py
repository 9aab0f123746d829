"""Several optimizer steps per batch (algo.ppo_epochs, learner.mini_batches) against the same steps taken by hand
with plain torch on a copy of the tiny model: AdamW with the trainer's settings, the proximal log-probs taken once
before the first step and held fixed, the advantages computed once on the whole batch.

What "the same" means after two AdamW steps. The first step moves a weight by lr * g / (|g| + eps_adam) (bias
corrections cancel), the second by lr * m2 / (sqrt(v2) + eps_adam) with m2, v2 the bias-corrected moments of g1, g2;
both are insensitive to rounding in g where |g| >> eps_adam, and lose all precision where |g| ~ eps_adam (most rows
of the tied embedding: the tokens absent from the batch). So the weights are compared where the hand-made gradients
of BOTH steps are >= WELL_CONDITIONED (1000 eps_adam after clipping). There the two runs differ only in the order of
float32 sums (micro-batches of 4 against one forward of the mini-batch, DeepSpeed's gradient norm), which moves a
gradient entry by ~64 eps_f32 of its tensor's scale (tests/learners/test_trainer.py's GRADIENT_TOLERANCE): for the
first step that moves delta W by <= lr eps_adam / |g| <= 1e-3 lr; for the second, m2 / sqrt(v2) moves by at most
~ |dg| / |g| relative (m2 and sqrt(v2) are sums of the same two gradients with positive weights), and g2 itself is
moved by the first step's weight differences (<= 1e-3 lr + eps_f32 |W| on these weights, up to lr on the
ill-conditioned ones, whose effect on the loss is through tokens of probability ~1 / 49152). 2 steps x 1e-3 lr + the
rounding of W + delta in each run (2 x 2 half-ulps): TOLERANCE = 4e-3 lr + 2 eps_f32 |W|. A step taken against the
wrong proximal policy (the current one, so the ratio is 1 again) is checked to be off by more than 10x that; a lost
or doubled step is off by ~lr.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learners.trainer import Trainer
from tests.learners.learner_fakes import learner_config, synthetic_batch

LR = 1e-3  # learner_config's
EPS_F32 = torch.finfo(torch.float32).eps
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, what learners/engine.py builds
WELL_CONDITIONED = 1e3 * ADAM_EPS
TOLERANCE = 4e-3 * LR  # + 2 eps_f32 |W|: see the module docstring

pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def batch() -> tuple[list, list]:
    groups = synthetic_batch(3, 2, 4)
    return groups, [np.zeros(g.size, dtype=np.int32) for g in groups]


def manual_steps(
    model_dir, batch, minis: list[slice], epochs: int, fixed_proximal: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """(weights before, weights after, the clipped gradients of every step) of `epochs` passes over `minis`
    with plain transformers + torch AdamW, GRPO advantages and the default TIS-corrected PPO loss."""
    from transformers import AutoModelForCausalLM

    from learners.advantages import broadcast_to_tokens, grpo_advantages
    from learners.batching import pad_groups
    from learners.logprobs import logprobs_from_logits
    from learners.losses import policy_loss

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    padded = pad_groups(*batch, pad_id=int(model.config.pad_token_id or 0))
    advantages = broadcast_to_tokens(grpo_advantages(padded.rewards, padded.group_ids), padded.loss_mask)

    def logprobs(rows: slice):
        inputs = padded.model_inputs(rows, torch.device("cpu"))
        out = model(**inputs.forward_kwargs(), logits_to_keep=inputs.num_predicted, use_cache=False)
        return logprobs_from_logits(out.logits[:, :-1], inputs.completion_tokens), inputs

    with torch.no_grad():
        proximal = [logprobs(rows)[0] for rows in minis]
    gradients = []
    for _ in range(epochs):
        for rows, prox in zip(minis, proximal):
            current, inputs = logprobs(rows)
            loss, _ = policy_loss(
                current,
                prox if fixed_proximal else current.detach(),
                inputs.behaviour_logprobs,
                advantages[rows, : inputs.width],
                inputs.loss_mask,
                clip_low=0.2,
                clip_high=0.28,
                correction="tis",
                tis_cap=2.0,
            )
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed's: coef = 1 / (norm + 1e-6) if < 1
            gradients.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
            optimizer.step()
    return before, {name: p.detach().clone() for name, p in model.named_parameters()}, gradients


def trainer_step(model_dir, dist, batch, **overrides) -> tuple[dict[str, torch.Tensor], dict[str, float], Trainer]:
    trainer = Trainer.from_config(learner_config(model_dir, learner__zero_stage=0, **overrides), dist)
    stats = trainer.train_step(*batch)
    return {name: t.detach().float().clone() for name, t in trainer.full_weights()}, stats, trainer


def excess(after: dict, reference: tuple) -> float:
    """max over the well-conditioned weights of |W - W_ref| - 2 eps_f32 |W_ref| - TOLERANCE (<= 0: the same)."""
    _, ref_after, gradients = reference
    worst = -float("inf")
    for name, w_ref in ref_after.items():
        where = torch.stack([g[name].abs() >= WELL_CONDITIONED for g in gradients]).all(dim=0)
        slack = (after[name] - w_ref).abs() - 2 * EPS_F32 * w_ref.abs()
        if where.any():
            worst = max(worst, float(slack[where].max()) - TOLERANCE)
    return worst


def test_two_epochs_equal_two_manual_steps_with_the_proximal_log_probs_fixed(tiny_model_dir, dist, batch) -> None:
    after, stats, trainer = trainer_step(tiny_model_dir, dist, batch, algo__ppo_epochs=2)
    reference = manual_steps(tiny_model_dir, batch, [slice(0, 8)], epochs=2)
    ratio_one = manual_steps(tiny_model_dir, batch, [slice(0, 8)], epochs=2, fixed_proximal=False)
    assert trainer.policy.optimizer_steps == 2
    assert excess(after, reference) <= 0
    # the proximal log-probs matter at the second step: taking the current ones instead is far outside the bound
    assert excess(ratio_one[1], reference) > 10 * TOLERANCE
    assert stats["policy/approx_kl/epoch_1"] == 0.0 and stats["policy/clip_frac/epoch_1"] == 0.0  # ratio 1
    assert stats["policy/approx_kl/epoch_2"] > 0 and stats["policy/clip_frac/epoch_2"] > 0  # the clip acts
    assert stats["policy/clip_frac"] == pytest.approx(stats["policy/clip_frac/epoch_2"] / 2)


def test_two_mini_batches_equal_two_manual_steps_on_the_halves(tiny_model_dir, dist, batch) -> None:
    after, stats, trainer = trainer_step(tiny_model_dir, dist, batch, learner__mini_batches=2)
    reference = manual_steps(tiny_model_dir, batch, [slice(0, 4), slice(4, 8)], epochs=1)
    assert trainer.policy.optimizer_steps == 2 and trainer.micro_steps == 1
    assert excess(after, reference) <= 0
    # which half steps first matters (AdamW's second step sees the first): the other order is outside the bound
    assert (
        excess(manual_steps(tiny_model_dir, batch, [slice(4, 8), slice(0, 4)], epochs=1)[1], reference) > 10 * TOLERANCE
    )
    assert "policy/clip_frac/epoch_1" not in stats and stats["policy/approx_kl"] > 0  # KL(prox || theta) at step 2


def test_mini_batches_that_cannot_divide_a_ranks_share_are_refused_at_load(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match=r"learner\.mini_batches: must divide a rank's share .* = 8 samples"):
        learner_config(tiny_model_dir, learner__mini_batches=3)
