"""Advantages of one batch for the configured estimator, with batch-level statistics over the GLOBAL batch.

    adv, returns = batch_advantages(algo, rewards, group_ids, mask, old_values=values, kl=kl, sum_ranks=all_reduce)

Pure functions on tensors (the math itself is in `learners.advantages`); `sum_ranks` sums a tensor over the
data-parallel ranks (identity with one rank), so that estimators that normalise over the batch (reinforce_pp,
reinforce_pp_baseline, the whitening of GAE advantages) see the global batch whatever the number of ranks.
Group estimators (grpo, dr_grpo, rloo) need no communication: a group never spans two ranks.

REINFORCE++ (reinforce_pp, reinforce_pp_baseline) whitens its per-token returns over every action token of the
global batch, with the KL in the reward or without it: a sample counts once per action token, so a long
completion weighs more in the batch mean and variance than a short one. This is OpenRLHF's weighting
(`compute_advantages_and_returns` in openrlhf/trainer/ppo_utils/experience_maker.py: the returns of
`get_cumulative_returns` are normalised with `mean = (adv * action_mask).sum() / action_mask.sum()` and the
masked population variance, for "reinforce" and "reinforce_baseline" alike), and it is continuous in
`algo.kl_coef`: as kl_coef -> 0 the KL-shaped returns tend to the sample reward on every token, which is
exactly the return without the KL.

Shapes: rewards [B], group_ids [B], mask [B, T] bool (action tokens), old_values [B, T] (gae), kl [B, T] (the
per-token KL estimate to put into the reward, or None). Returns advantages [B, T] (0 off the action tokens) and,
for gae, the returns [B, T] the critic regresses on (else None).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.config import KL_IN_REWARD_ESTIMATORS, AlgoConfig
from learners.advantages import (
    broadcast_to_tokens,
    checked_rewards,
    gae_advantages,
    grpo_advantages,
    rloo_advantages,
    token_returns_with_kl,
)

SumRanks = Callable[[torch.Tensor], torch.Tensor]


def _alone(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def whiten_across_ranks(
    x: torch.Tensor, mask: torch.Tensor, sum_ranks: SumRanks = _alone, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten `x` over the unmasked elements of every rank's `x` (a collective when ranks > 1).

    (x - mu) / sqrt(var + eps) on unmasked positions, 0 elsewhere; mu and the population variance (divide by N)
    are over all unmasked elements of all ranks (two sums of two scalars across ranks), computed in float64.
    Values at masked positions never reach mu, var or the output (they may be inf/NaN). x, mask: same shape;
    returns float32 of that shape. Elements that are all equal give exactly 0 when their count is below 2**29
    and they are float32 values (the float64 sums are then exact).
    """
    m = mask.bool()
    x = torch.where(m, x, 0).double()
    totals = sum_ranks(torch.stack([x.sum(), m.sum().double()]))
    count = totals[1].clamp(min=1)
    mu = totals[0] / count
    var = sum_ranks(torch.where(m, (x - mu) ** 2, 0).sum().reshape(1))[0] / count
    return torch.where(m, (x - mu) * torch.rsqrt(var + eps), 0).float()


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token rewards [B, T]: each sample's reward on its last action token, 0 elsewhere (and in empty rows)."""
    last = mask.shape[1] - 1 - mask.flip(1).to(torch.uint8).argmax(dim=1)  # [B]
    terminal = torch.where(mask.any(dim=1), rewards, 0)[:, None]  # [B, 1]
    return torch.zeros(mask.shape, dtype=rewards.dtype).scatter(1, last[:, None], terminal)


@torch.no_grad()
def batch_advantages(
    algo: AlgoConfig,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_values: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
    sum_ranks: SumRanks = _alone,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages [B, T], returns [B, T] or None) for `algo.estimator` (see the module docstring).

    `kl` (already an estimate per token) goes into the reward, scaled by `algo.kl_coef`: as REINFORCE++'s
    per-token penalty (reinforce_pp*) or into GAE's token rewards. The config refuses `algo.kl_in_reward` for the
    other estimators; this function raises ValueError when `kl` is passed to one of them anyway (it has no
    per-token reward to put it in), or when gae gets no `old_values`.
    """
    if kl is not None and algo.estimator not in KL_IN_REWARD_ESTIMATORS:
        raise ValueError(f"kl: estimator '{algo.estimator}' has no per-token reward (only {KL_IN_REWARD_ESTIMATORS})")
    if algo.estimator in ("grpo", "dr_grpo"):
        return broadcast_to_tokens(grpo_advantages(rewards, group_ids, algo.estimator == "grpo"), mask), None
    if algo.estimator == "rloo":
        return broadcast_to_tokens(rloo_advantages(rewards, group_ids), mask), None
    if algo.estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        if algo.estimator == "reinforce_pp":
            base = checked_rewards(rewards)  # [B]
        else:
            base = grpo_advantages(rewards, group_ids, scale_by_std=False)  # [B]  r - mean of its group
        if kl is None:
            returns = broadcast_to_tokens(base, mask)  # [B, T]  the sample reward on each of its action tokens
        else:
            returns = token_returns_with_kl(base, kl, mask, algo.kl_coef)  # [B, T]  reward-to-go with the KL
        return whiten_across_ranks(returns, mask, sum_ranks), None  # each action token once (see the docstring)
    if old_values is None:
        raise ValueError("estimator 'gae' needs the critic's values (old_values)")
    token_rewards = terminal_rewards(rewards, mask)  # [B, T]
    if kl is not None:
        token_rewards = token_rewards - algo.kl_coef * kl
    advantages, returns = gae_advantages(token_rewards, old_values, mask, algo.gamma, algo.lam)
    return whiten_across_ranks(advantages, mask, sum_ranks), returns
