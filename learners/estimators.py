"""Advantages of one batch for the configured estimator, with batch-level statistics over the GLOBAL batch.

    adv, returns = batch_advantages(algo, rewards, group_ids, mask, old_values=values, kl=kl, sum_ranks=all_reduce)

Pure functions on tensors (the math itself is in `learners.advantages`); `sum_ranks` sums a tensor over the
data-parallel ranks (identity with one rank), so that estimators that normalise over the batch (reinforce_pp,
reinforce_pp_baseline, the whitening of GAE advantages) see the global batch whatever the number of ranks.
Group estimators (grpo, dr_grpo, rloo) need no communication: a group never spans two ranks.

Shapes: rewards [B], group_ids [B], mask [B, T] bool (action tokens), old_values [B, T] (gae), kl [B, T] (the
per-token KL estimate to put into the reward, or None). Returns advantages [B, T] (0 off the action tokens) and,
for gae, the returns [B, T] the critic regresses on (else None).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.config import AlgoConfig
from learners.advantages import (
    broadcast_to_tokens,
    gae_advantages,
    grpo_advantages,
    rloo_advantages,
    token_returns_with_kl,
)

SumRanks = Callable[[torch.Tensor], torch.Tensor]
KL_IN_REWARD_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")


def check_kl_in_reward(algo: AlgoConfig) -> None:
    """Raise ValueError, saying what to change, when the KL is to go into the reward of a group estimator."""
    if algo.estimator not in KL_IN_REWARD_ESTIMATORS:
        raise ValueError(
            f"algo.kl_in_reward: only with estimator in {KL_IN_REWARD_ESTIMATORS} "
            f"(got '{algo.estimator}'); set algo.kl_in_reward = false to put the KL in the loss"
        )


def _alone(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def whiten_across_ranks(
    x: torch.Tensor, mask: torch.Tensor, sum_ranks: SumRanks = _alone, eps: float = 1e-8
) -> torch.Tensor:
    """`advantages.masked_whiten(x, mask)` over the union of every rank's `x` (a collective when ranks > 1).

    (x - mu) / sqrt(var + eps) on unmasked positions, 0 elsewhere; mu and the population var are over all
    unmasked elements of all ranks (two sums of two scalars across ranks).
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
    per-token penalty (reinforce_pp*) or into GAE's token rewards. Raises ValueError when `kl` is given to a
    group estimator, or gae gets no `old_values`.
    """
    if kl is not None:
        check_kl_in_reward(algo)
    if algo.estimator in ("grpo", "dr_grpo"):
        return broadcast_to_tokens(grpo_advantages(rewards, group_ids, algo.estimator == "grpo"), mask), None
    if algo.estimator == "rloo":
        return broadcast_to_tokens(rloo_advantages(rewards, group_ids), mask), None
    if algo.estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        base = rewards if algo.estimator == "reinforce_pp" else grpo_advantages(rewards, group_ids, False)  # [B]
        if kl is not None:
            return whiten_across_ranks(token_returns_with_kl(base, kl, mask, algo.kl_coef), mask, sum_ranks), None
        sample = whiten_across_ranks(base, torch.ones_like(base, dtype=torch.bool), sum_ranks)  # [B]
        return broadcast_to_tokens(sample, mask), None
    if old_values is None:
        raise ValueError("estimator 'gae' needs the critic's values (old_values)")
    token_rewards = terminal_rewards(rewards, mask)  # [B, T]
    if kl is not None:
        token_rewards = token_rewards - algo.kl_coef * kl
    advantages, returns = gae_advantages(token_rewards, old_values, mask, algo.gamma, algo.lam)
    return whiten_across_ranks(advantages, mask, sum_ranks), returns
