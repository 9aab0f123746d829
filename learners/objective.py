"""What the RL update optimizes, on tensors (used by `learners.trainer`): the overlong shaping of the batch, the
advantages, and each micro-batch's policy and value objectives with the statistics they record. No engine, no
process group (a collective comes in as `sum_ranks`) and no device assumption.

    truncated, penalty = overlong_shaping(algo, groups, batch, budget, window)             # bool [B], float32 [B]
    advantages, returns = advantages_and_returns(algo, replace(batch, rewards=batch.rewards + penalty), pre, ...)
    batch = overlong_masked(algo, batch, truncated)                  # after the advantages: baselines still count them
    loss = policy_objective(algo, inputs, logprobs, entropy, proximal, ref, advantages[rows], stats, ...)  # [b, T']
    critic_loss = value_objective(algo, values, old_values[rows], returns[rows], mask, stats, ...)
    metrics = overlong_metrics(truncated, penalty, sum_ranks)                              # a collective

algo.overlong (`learners.overlong`): "penalty" adds DAPO's soft overlong penalty to the rewards first (so every
estimator sees it); "mask" clears the truncated samples' loss mask after the advantages (their rewards stay in the
group baselines), so the update and its denominators leave them out.

The policy objective: `learners.losses.policy_loss` with the configured correction against `behaviour_logprobs`
(+ KL term, - entropy bonus), aggregated over the micro-batch's own units. The proximal policy is the one before
the batch's first step: with several steps its log-probs come from the trainer's no-grad pass and stay fixed, so
the PPO ratio pi_theta / pi_prox moves and the clip acts from the second step on, while the importance weight
pi_prox / pi_behaviour carries the off-policy correction (decoupled PPO / TIS). With one step per batch
proximal = logprobs.detach() (the same numbers, no extra pass): the ratio is 1.

Metrics: `policy/kl` is the mean k3 estimate of KL(pi_theta || pi_ref) when a reference is loaded, else of
KL(pi_behaviour || pi_theta) on the sampled tokens (how far the trained weights are from the ones that sampled);
`policy/kl_behaviour` is the latter, always. `policy/approx_kl` is the k3 estimate of KL(pi_prox || pi_theta) on
the sampled tokens (mean over action tokens; 0 at the first step, where theta = prox). Losses and policy
statistics are means over all the steps of the batch (each epoch weighted equally); with ppo_epochs > 1,
`policy/clip_frac/epoch_k` and `policy/approx_kl/epoch_k` are epoch k's alone (k = 1..ppo_epochs).
`rollout/truncated_share` is the share of the batch's samples cut at the token limit (finish reason `length`),
`reward/overlong_penalty` the mean penalty added to their rewards (0 unless algo.overlong = "penalty"); with
algo.ratio = "sequence" (GSPO), `policy/seq_clip_frac` is the share of sequences whose clip is active.
With algo.policy_loss = "sapo", `policy/sapo_gate_mean` is the mean soft gate (1 = the on-policy gradient);
with "cispo", `policy/clip_frac` counts the tokens whose weight was clipped (they keep a gradient).
`policy/is_masked_frac` is the share of action tokens that algo.is_mask rejected (rho = pi_prox / pi_behaviour
outside [is_mask_low, is_mask_high]), `policy/is_masked_seq_frac` the share of sequences with a rejected token; both
0 with is_mask = "none". A rejected token leaves its micro-batch's loss and denominator (`policy_loss`); the
micro-batch itself is still weighted by its share of the batch's loss units counted before the rejection (the
trainer counts them before the forward), so with several micro-batches per step the step is a weighted mean of
per-micro-batch kept-token means, not one mean over the kept tokens of the whole step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from common.config import AlgoConfig
from common.types import RolloutGroup
from learners.batching import ModelInputs, PaddedBatch
from learners.distillation import distill_advantages
from learners.estimators import SumRanks, batch_advantages
from learners.losses import kl_estimate, policy_loss, value_loss
from learners.overlong import mask_rows, model_tokens, overlong_penalty, truncated_rows
from learners.rollout_stats import Reduce
from learners.update_stats import GlobalAverages, aggregate


@dataclass
class PreUpdate:
    """No-grad quantities for the batch, [B, T] each (None when the configuration does not need them)."""

    ref_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None  # the policy before the update: the proximal policy, kl_in_reward's pi
    teacher_logprobs: torch.Tensor | None = None  # algo.teacher_model's (learners.distillation)


def overlong_shaping(
    algo: AlgoConfig, groups: Sequence[RolloutGroup], batch: PaddedBatch, budget: int, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(truncated bool [B], penalty float32 [B]): the rows cut at the token limit, and the reward penalty of
    algo.overlong = "penalty" (L_max = `budget`, L_cache = `window`; zeros otherwise), in `batch`'s row order."""
    truncated = truncated_rows(groups)  # [B]
    penalty = torch.zeros(batch.size)  # [B]
    if algo.overlong == "penalty":
        lengths = model_tokens(batch.loss_mask)
        penalty = overlong_penalty(lengths, budget, window, algo.overlong_penalty)
    return truncated, penalty


def overlong_masked(algo: AlgoConfig, batch: PaddedBatch, truncated: torch.Tensor) -> PaddedBatch:
    """With algo.overlong = "mask", `batch` without the truncated rows in its loss mask; else `batch` itself."""
    if algo.overlong == "mask":
        return replace(batch, loss_mask=mask_rows(batch.loss_mask, truncated))
    return batch


def overlong_metrics(truncated: torch.Tensor, penalty: torch.Tensor, sum_ranks: Reduce) -> dict[str, float]:
    """rollout/truncated_share (finish reason `length`) and reward/overlong_penalty (the mean penalty added
    to the rewards; 0 unless algo.overlong = "penalty"), over the samples of the global batch (a collective)."""
    local = np.array([truncated.numel(), float(truncated.sum()), float(penalty.double().sum())])
    count, cut, total = sum_ranks(local)
    count = max(count, 1.0)
    return {"rollout/truncated_share": float(cut / count), "reward/overlong_penalty": float(total / count)}


def advantages_and_returns(
    algo: AlgoConfig, batch: PaddedBatch, pre: PreUpdate, sum_ranks: SumRanks
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages [B, T], returns [B, T] for the critic or None), zero off the action tokens
    (`learners.estimators.batch_advantages`; the KL to the reference goes into the reward when both log-probs
    were taken, i.e. with algo.kl_in_reward), with the teacher's term when it scored the batch
    (`learners.distillation.distill_advantages`; the critic's returns do not see it)."""
    kl = None
    if pre.logprobs is not None and pre.ref_logprobs is not None:
        kl = kl_estimate(pre.logprobs, pre.ref_logprobs, algo.kl_estimator, batch.loss_mask)  # [B, T]
    advantages, returns = batch_advantages(
        algo,
        batch.rewards,
        batch.group_ids,
        batch.loss_mask,
        old_values=pre.old_values,
        kl=kl,
        sum_ranks=sum_ranks,
    )
    if pre.teacher_logprobs is not None:
        advantages = distill_advantages(
            advantages, pre.logprobs, pre.teacher_logprobs, batch.loss_mask, algo.distill_coef, algo.distill_alone
        )
    return advantages, returns


def policy_objective(
    algo: AlgoConfig,
    inputs: ModelInputs,
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    proximal: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    stats: GlobalAverages,
    loss_share: float,
    token_share: float,
    epoch: int = 1,
) -> torch.Tensor:
    """The micro-batch's loss, aggregated over its own units: policy loss + KL term - entropy bonus.

    `logprobs` and `entropy` [b, T'] are the policy's (with grad), `proximal` and `ref_logprobs` (None: no
    reference) [b, T'] constants, `advantages` [b, T']; the behaviour log-probs and the loss mask are `inputs`'.
    Records its terms (weighted by `loss_share`) and token statistics (by `token_share`) in `stats`, and the
    clip fraction and approx-KL also under `.../epoch_{epoch}` when there are several epochs."""
    mask = inputs.loss_mask
    loss, parts = policy_loss(
        logprobs,
        proximal,
        inputs.behaviour_logprobs,
        advantages,
        mask,
        clip_low=algo.clip_low,
        clip_high=algo.clip_high,
        dual_clip=algo.dual_clip,
        correction=algo.correction,
        tis_level=algo.tis_level,
        tis_cap=algo.tis_cap,
        aggregation=algo.aggregation,
        ratio=algo.ratio,
        is_mask=algo.is_mask,
        is_mask_low=algo.is_mask_low,
        is_mask_high=algo.is_mask_high,
        kind=algo.policy_loss,
        sapo_tau_pos=algo.sapo_tau_pos,
        sapo_tau_neg=algo.sapo_tau_neg,
    )
    stats.add("loss/policy", loss, loss_share)
    if "seq_clip_frac" in parts:  # ratio = "sequence" needs seq_mean: loss_share is the share of its rows
        stats.add("policy/seq_clip_frac", parts["seq_clip_frac"], loss_share)
    kl_loss = torch.zeros(())
    kl_behaviour = kl_estimate(inputs.behaviour_logprobs, logprobs.detach(), "k3", mask)  # KL(pi_b || pi)
    kl_metric = kl_behaviour
    if ref_logprobs is not None:
        kl_metric = kl_estimate(logprobs.detach(), ref_logprobs, "k3", mask)  # KL(pi || pi_ref)
        if not algo.kl_in_reward:
            kl_loss = aggregate(kl_estimate(logprobs, ref_logprobs, algo.kl_estimator, mask), mask, algo.aggregation)
            loss = loss + algo.kl_coef * kl_loss
    if algo.entropy_coef > 0:
        loss = loss - algo.entropy_coef * aggregate(entropy, mask, algo.aggregation)
    stats.add("loss/kl", kl_loss, loss_share)
    stats.add("loss/total", loss, loss_share)
    for name, per_token in (
        ("policy/kl", kl_metric),
        ("policy/kl_behaviour", kl_behaviour),
        ("policy/entropy", entropy),
    ):
        stats.add(name, aggregate(per_token.detach(), mask, "token_mean"), token_share)
    approx_kl = aggregate(kl_estimate(proximal, logprobs.detach(), "k3", mask), mask, "token_mean")
    for name, value in (("policy/clip_frac", parts["clip_frac"]), ("policy/approx_kl", approx_kl)):
        stats.add(name, value, token_share)  # KL(pi_prox || pi_theta) on the sampled tokens
        if algo.ppo_epochs > 1:
            stats.add(f"{name}/epoch_{epoch}", value, token_share * algo.ppo_epochs)
    stats.add("policy/iw_mean", parts["is_weight_mean"], token_share)
    stats.add("policy/iw_truncated_frac", parts["is_truncated_frac"], token_share)
    stats.add("policy/is_masked_frac", parts["is_masked_frac"], token_share)
    stats.add("policy/is_masked_seq_frac", parts["is_masked_seq_frac"], token_share)
    stats.peak("policy/iw_max", parts["is_weight_max"])
    if "sapo_gate_mean" in parts:  # algo.policy_loss = "sapo"
        stats.add("policy/sapo_gate_mean", parts["sapo_gate_mean"], token_share)
    return loss


def value_objective(
    algo: AlgoConfig,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    stats: GlobalAverages,
    loss_share: float,
    token_share: float,
) -> torch.Tensor:
    """The critic's clipped value loss on the micro-batch (`learners.losses.value_loss`; [b, T'] inputs, `values`
    with grad), recorded in `stats` as loss/value (by `loss_share`) and critic/clip_frac (by `token_share`)."""
    loss, value_stats = value_loss(
        values, old_values, returns, mask, clip=algo.value_clip or None, aggregation=algo.aggregation
    )
    stats.add("loss/value", loss, loss_share)
    stats.add("critic/clip_frac", value_stats["clip_frac"], token_share)
    return loss
