"""Advantages and returns for the learner: pure functions on torch tensors (any device, no engine).

Shapes: B samples (sequences), T completion tokens (right-padded), G groups (prompts).
`mask` [B, T] (bool or float; any nonzero value counts as 1) is 1 on action tokens, the completion tokens
the policy sampled, and 0 on padding and on environment tokens of multi-turn completions (`loss_mask`).
Values at mask == 0 positions may be arbitrary, even inf/NaN: inputs are selected with `torch.where` before
any arithmetic, so those positions reach neither a result nor a gradient; outputs are 0 there.

Sample-level estimators take rewards [B] and group_ids [B] (any integer ids, in any order, groups of any
size) and return advantages [B]; `broadcast_to_tokens` puts them on the action tokens. Advantages and returns
are constants of the policy loss: the estimators run under `torch.no_grad()`.

    adv = grpo_advantages(rewards, group_ids)                  # [B]       GRPO
    adv = broadcast_to_tokens(adv, mask)                       # [B, T]
    ret = token_returns_with_kl(rewards, kl, mask, kl_coef)    # [B, T]    REINFORCE++ (KL in the reward)
    adv, ret = gae_advantages(token_rewards, values, mask, gamma=1.0, lam=0.95)   # PPO with a critic

Normalisations over the whole batch (REINFORCE++'s whitening, GAE's advantage whitening) span the data-parallel
ranks and live in `learners.estimators` (`whiten_across_ranks`, `batch_advantages`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "broadcast_to_tokens",
    "checked_rewards",
    "contiguous_group_ids",
    "gae_advantages",
    "grpo_advantages",
    "masked_mean",
    "rloo_advantages",
    "token_returns_with_kl",
]


def action_mask(mask: Tensor, shape: torch.Size) -> Tensor:
    """`mask` as bool (nonzero -> True), after checking that it has `shape`; raises ValueError otherwise."""
    if mask.shape != shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(shape)} (the tensor it masks)")
    return mask if mask.dtype == torch.bool else mask != 0


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over the positions where `mask` is nonzero: sum_i m_i x_i / sum_i m_i.

    x, mask: same shape. dim=None reduces everything to a 0-d tensor; dim=d reduces that dimension.
    A slice with no unmasked position has mean 0 (not NaN). Differentiable; masked positions get zero gradient.
    """
    m = action_mask(mask, x.shape)
    total = torch.where(m, x, 0).sum() if dim is None else torch.where(m, x, 0).sum(dim)
    count = m.sum() if dim is None else m.sum(dim)
    return total / count.clamp(min=1)


def contiguous_group_ids(num_samples: int, group_size: int, device: torch.device | str | None = None) -> Tensor:
    """Group ids [B] for the [G, n] layout (samples of a group adjacent): ids = [0]*n + [1]*n + ... .

    Lets rewards shaped [G, n] use the main API: grpo_advantages(r.reshape(-1), contiguous_group_ids(G*n, n)).
    Raises ValueError when num_samples is not a multiple of group_size.
    """
    if group_size < 1 or num_samples % group_size != 0:
        raise ValueError(f"num_samples={num_samples} is not a multiple of group_size={group_size}")
    return torch.arange(num_samples, device=device) // group_size


def checked_rewards(rewards: Tensor) -> Tensor:
    """rewards [B] as a float tensor; raises ValueError if empty, not 1-d, or not finite."""
    if rewards.dim() != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards must be a non-empty [B] tensor, got shape {tuple(rewards.shape)}")
    r = rewards if rewards.is_floating_point() else rewards.float()
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards contain inf/NaN; fix the reward function (it poisons the group's baseline)")
    return r


def _group_index(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Checks the inputs; returns (rewards as float [B], inverse index [B] in [0, G), counts [G], ids [G])."""
    r = checked_rewards(rewards)
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, rewards {tuple(rewards.shape)}")
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    ids, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return r, inverse, counts, ids


def _group_deviation(r: Tensor, inverse: Tensor, counts: Tensor) -> Tensor:
    """r_i - mean of r_i's group [B]; exactly 0 in a group whose rewards are all equal (no rounding residue)."""
    num_groups = counts.numel()
    mean = r.new_zeros(num_groups).index_add_(0, inverse, r) / counts  # [G]
    hi = r.new_zeros(num_groups).scatter_reduce_(0, inverse, r, "amax", include_self=False)  # [G]
    lo = r.new_zeros(num_groups).scatter_reduce_(0, inverse, r, "amin", include_self=False)  # [G]
    return torch.where((hi == lo)[inverse], 0, r - mean[inverse])  # [B]


@torch.no_grad()
def grpo_advantages(rewards: Tensor, group_ids: Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantages [B]: A_i = (r_i - mean_g) / (std_g + eps), g = group of i.

    scale_by_std=False is Dr. GRPO: A_i = r_i - mean_g.
    std_g is the *unbiased* sample std, sqrt(sum_{j in g} (r_j - mean_g)^2 / (n_g - 1)). The DeepSeekMath paper
    writes std(r) without saying which; the implementations that reproduce it (TRL's GRPOTrainer, verl,
    OpenRLHF) all use torch.std's default, the unbiased one, so that is what we use.
    A group whose rewards are all equal (including a group of one) gets A = 0 exactly.
    rewards: [B] float; group_ids: [B] integer, unsorted, groups may differ in size.
    """
    r, inverse, counts, _ = _group_index(rewards, group_ids)
    dev = _group_deviation(r, inverse, counts)  # [B]
    if not scale_by_std:
        return dev
    sq = r.new_zeros(counts.numel()).index_add_(0, inverse, dev * dev)  # [G]
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))  # [G]  unbiased
    return dev / (std[inverse] + eps)


@torch.no_grad()
def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO advantages [B]: A_i = r_i - (1/(n_g - 1)) sum_{j in g, j != i} r_j = n_g/(n_g - 1) (r_i - mean_g).

    rewards: [B] float; group_ids: [B] integer, unsorted, groups may differ in size.
    Raises ValueError if any group has a single sample (the leave-one-out baseline is undefined).
    """
    r, inverse, counts, ids = _group_index(rewards, group_ids)
    if bool((counts < 2).any()):
        lonely = ids[counts < 2][:10].tolist()
        raise ValueError(
            f"RLOO needs >= 2 samples per group; groups {lonely} have 1. "
            "Sample n >= 2 completions per prompt, or use grpo_advantages."
        )
    scale = counts / (counts - 1)  # [G]
    return _group_deviation(r, inverse, counts) * scale[inverse]


def broadcast_to_tokens(sample_values: Tensor, mask: Tensor) -> Tensor:
    """Sample-level values [B] onto tokens [B, T]: out[b, t] = v[b] where mask[b, t] else 0."""
    if sample_values.dim() != 1 or mask.dim() != 2 or sample_values.shape[0] != mask.shape[0]:
        raise ValueError(f"need values [B] and mask [B, T], got {tuple(sample_values.shape)}, {tuple(mask.shape)}")
    m = action_mask(mask, mask.shape)
    return torch.where(m, sample_values[:, None], 0)


@torch.no_grad()
def token_returns_with_kl(rewards: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """REINFORCE++ per-token returns [B, T]: reward-to-go (gamma = 1) of the KL-shaped token rewards.

    Token reward: r_t = -kl_coef * kl_t on every action token, plus the sample reward R on the last action
    token of the sequence. Return: G_t = sum_{s >= t, mask_s = 1} r_s on action tokens, 0 elsewhere
    (environment tokens earn nothing and do not stop the sum). REINFORCE++ then whitens G over all action
    tokens of the global batch (`estimators.whiten_across_ranks`).
    rewards: [B]; kl: [B, T] per-token estimate of KL(pi_theta || pi_ref) (see `losses.kl_estimate`);
    mask: [B, T]. A row without action tokens has returns 0 (its reward has no token to land on).
    """
    m = action_mask(mask, kl.shape)
    if rewards.shape != kl.shape[:1]:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}, expected [{kl.shape[0]}]")
    token_rewards = torch.where(m, -kl_coef * kl, 0)  # [B, T]
    last = kl.shape[1] - 1 - m.flip(1).to(torch.uint8).argmax(dim=1)  # [B]  last action token
    terminal = torch.where(m.any(dim=1), rewards.to(token_rewards.dtype), 0)  # [B]
    token_rewards = token_rewards.scatter_add(1, last[:, None], terminal[:, None])  # [B, T]
    returns = token_rewards.flip(1).cumsum(1).flip(1)  # [B, T]  reward-to-go
    return torch.where(m, returns, 0)


@torch.no_grad()
def gae_advantages(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the action tokens only: (advantages [B, T], returns [B, T]).

    Let t_1 < ... < t_K be the action positions of a row (mask = 1). For k = K..1:
        delta_k = r_{t_k} + gamma * V_{t_{k+1}} - V_{t_k}        (V_{t_{K+1}} = 0: the completion ends)
        A_k     = delta_k + gamma * lam * A_{k+1}                  (A_{K+1} = 0)
        returns_k = A_k + V_{t_k}
    Masked positions are skipped, not treated as steps: across environment tokens of a multi-turn
    completion the value of the *next action token* bootstraps, and gamma/lam discount per action, not per
    position. Rewards and values at masked positions are ignored, so put every reward on an action token
    (the terminal reward on the last one). token_rewards, values, mask: [B, T]; outputs 0 where mask == 0.
    """
    m = action_mask(mask, token_rewards.shape)
    if values.shape != token_rewards.shape:
        raise ValueError(f"values has shape {tuple(values.shape)}, rewards {tuple(token_rewards.shape)}")
    r = torch.where(m, token_rewards, 0)  # [B, T]
    v = torch.where(m, values, 0).to(r.dtype)  # [B, T]
    adv = torch.zeros_like(r)  # [B, T]
    next_value = r.new_zeros(r.shape[0])  # [B]  value of the next action token
    next_adv = r.new_zeros(r.shape[0])  # [B]
    for t in reversed(range(r.shape[1])):
        a_t = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv  # [B]
        act = m[:, t]  # [B]
        adv[:, t] = torch.where(act, a_t, 0)
        next_value = torch.where(act, v[:, t], next_value)
        next_adv = torch.where(act, a_t, next_adv)
    return adv, torch.where(m, adv + v, 0)
