"""Completions cut at the token limit (finish reason `length`): mask them out of the loss, or DAPO's soft penalty.

    truncated = truncated_rows(groups)                                          # bool [B], pad_groups' row order
    penalty = overlong_penalty(model_tokens(loss_mask), budget, window, scale)  # [B], added to the rewards
    loss_mask = mask_rows(loss_mask, truncated)                                 # [B, T]  algo.overlong = "mask"

A truncated completion has no ending: its reward judges an answer the model never finished, so training on it
teaches the wrong thing either way (DAPO, Yu et al. 2025, section 3.4). Two remedies, `algo.overlong`:
  mask     the sample stays in the batch and in its group's baseline (the advantages of the other samples are
           exactly those without the option: the group's mean and std still count it), but its tokens leave the
           loss mask, so it adds nothing to the policy loss, the KL term, the entropy bonus or the critic's loss.
           The aggregation denominators follow the mask: token_mean divides by the action tokens of the samples
           that remain, seq_mean by the samples that remain, so the step's scale does not shrink with the
           truncated share (a batch where every sample is truncated has loss 0).
  penalty  DAPO's soft overlong punishment (eq. 13) on the model-generated token count |y|, with L_max = the
           budget and L_cache = the window, added (times `algo.overlong_penalty`) to the reward before any
           estimator sees it:
               R_len(y) = 0                                  |y| <= L_max - L_cache
                        = ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
                        = -1                                 |y| > L_max
           The generator stops a single-turn completion at L_max = generator.max_tokens, so |y| <= L_max always:
           a truncated sample has |y| = L_max exactly and gets -1 from the middle line (= the limit of the last), and
           a sample that stopped by itself within the window gets a share of it. The last line is reached only by
           a multi-turn episode, where L_max is env.max_total_tokens (model + environment tokens; its model tokens,
           which |y| counts, stay below it), so in practice not at all. It reads lengths only, not finish reasons.
Multi-turn: |y| counts the model-generated tokens (the loss mask's ones), not the environment's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.eval_metrics import TRUNCATED
from common.types import RolloutGroup

__all__ = ["mask_rows", "model_tokens", "overlong_penalty", "truncated_rows"]


def truncated_rows(groups: Sequence[RolloutGroup]) -> torch.Tensor:
    """bool [B]: finish reason `length` (cut at the token limit), in `learners.batching.pad_groups`' row order
    (each group's samples in turn)."""
    flags = [reason == TRUNCATED for group in groups for reason in group.finish_reasons]
    return torch.tensor(flags, dtype=torch.bool)


def model_tokens(loss_mask: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the model-generated tokens of each row (the loss mask's ones; environment tokens are 0 there)."""
    return loss_mask.bool().sum(dim=1)


def overlong_penalty(lengths: torch.Tensor, budget: int, window: int, scale: float = 1.0) -> torch.Tensor:
    """float32 [B]: scale * R_len(|y|) of the module docstring, for lengths [B] (integer token counts), L_max =
    `budget` and L_cache = `window`. Raises ValueError unless 1 <= window <= budget and scale >= 0."""
    if not 1 <= window <= budget:
        raise ValueError(f"need 1 <= window <= budget, got window={window}, budget={budget}")
    if not scale >= 0:
        raise ValueError(f"scale must be >= 0, got {scale}")
    y = lengths.to(torch.float64)
    start = budget - window  # L_max - L_cache: the window's first excluded length
    ramp = (start - y) / window  # [B]  in [-1, 0) inside the window
    penalty = torch.where(y <= start, 0.0, torch.where(y <= budget, ramp, -1.0))
    return (scale * penalty).to(torch.float32)


def mask_rows(loss_mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """loss_mask [B, T] with every token of the rows where `rows` [B] (bool) is True cleared."""
    if rows.shape != loss_mask.shape[:1]:
        raise ValueError(f"rows has shape {tuple(rows.shape)}, loss_mask {tuple(loss_mask.shape)}")
    return loss_mask.bool() & ~rows[:, None]
