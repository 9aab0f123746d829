"""Right padding of token rows into one batch, for every role that runs a model over rows of different lengths
(the offline stages' learners, `learners.offline.data`; the reward model's scorer, `actors.rewards.model`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


def pad_right(rows: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Rows of different lengths as one right-padded batch: ids [B, L] long (pad_id after each row's end) and a
    mask [B, L] bool (True on the rows' own positions), L = the longest row (0 for no rows or only empty rows).
    Rows may hold bools (a loss mask, padded with pad_id 0)."""
    import torch

    width = max((len(row) for row in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, L]
    mask = torch.zeros((len(rows), width), dtype=torch.bool)  # [B, L]
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[b, : len(row)] = True
    return ids, mask
