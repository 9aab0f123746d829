"""Rollout groups -> padded tensors, and the micro-batches one update is split into.

    batch = pad_groups(groups, staleness, pad_id, first_group_id=rank * len(groups))
    for mini in mini_batch_rows(batch.size, mini_batches, micro_steps):   # one optimizer step per mini-batch
        for rows in mini:                                     # contiguous row slices, micro_steps of them
            inputs = batch.model_inputs(rows, device)         # prompt + completion, padded for this micro-batch
            logits = model(**inputs.forward_kwargs(), logits_to_keep=inputs.num_predicted)

Layout (B samples, T = the longest completion of the batch):
  * Completion tensors are [B, T], right-padded: completion token t of sample b is `completion_tokens[b, t]`;
    `loss_mask[b, t]` is 1 only on action tokens (the group's loss_mask) inside the completion.
  * A micro-batch's model input is [b, P + T'] with P its longest prompt and T' its longest completion: prompts
    are LEFT-padded, so every completion starts at column P, and completions right-padded. position_ids count
    real tokens only (a sample sees the positions it would see unpadded). The logits that predict the
    completion are the last T' + 1 positions minus the last one (`ModelInputs.num_predicted` = T' + 1).
  * Samples of one group are adjacent and keep the group's order; `group_ids` are `first_group_id + index`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.types import RolloutGroup

Rows = slice | torch.Tensor  # a micro-batch's rows of a PaddedBatch: a slice, or int64 row indices


@dataclass
class PaddedBatch:
    """One rank's share of a batch, padded (shapes in the module docstring). Host tensors."""

    prompts: list[np.ndarray]  # [B] int32 [P_b] (a group's samples share one array)
    completion_tokens: torch.Tensor  # int64 [B, T], pad_id after each completion
    completion_lengths: torch.Tensor  # int64 [B]
    loss_mask: torch.Tensor  # bool [B, T]
    behaviour_logprobs: torch.Tensor  # float32 [B, T], 0 where loss_mask = 0
    rewards: torch.Tensor  # float32 [B]
    group_ids: torch.Tensor  # int64 [B]
    staleness: torch.Tensor  # int64 [B]
    pad_id: int

    @property
    def size(self) -> int:
        return len(self.prompts)

    @property
    def width(self) -> int:
        return int(self.completion_tokens.shape[1])

    def num_tokens(self) -> int:
        """Prompt + completion tokens of every sample (what a forward pass processes, padding excluded)."""
        return int(sum(len(p) for p in self.prompts) + self.completion_lengths.sum())

    def model_inputs(self, rows: Rows, device: torch.device) -> ModelInputs:
        """The padded model input of rows `rows` (see the module docstring), on `device`."""
        prompts = self.prompts[rows] if isinstance(rows, slice) else [self.prompts[int(r)] for r in rows]
        lengths = self.completion_lengths[rows]
        prompt_width = max(len(p) for p in prompts)
        width = max(int(lengths.max()), 1)
        input_ids = torch.full((len(prompts), prompt_width + width), self.pad_id, dtype=torch.int64)
        attention_mask = torch.zeros_like(input_ids)
        for i, prompt in enumerate(prompts):
            input_ids[i, prompt_width - len(prompt) : prompt_width] = torch.from_numpy(prompt.astype(np.int64))
            attention_mask[i, prompt_width - len(prompt) : prompt_width + int(lengths[i])] = 1
        input_ids[:, prompt_width:] = self.completion_tokens[rows, :width]
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
        return ModelInputs(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            completion_tokens=self.completion_tokens[rows, :width].to(device),
            loss_mask=self.loss_mask[rows, :width].to(device),
            behaviour_logprobs=self.behaviour_logprobs[rows, :width].to(device),
        )


@dataclass
class ModelInputs:
    """One micro-batch: model input [b, P + T'] and the completion-aligned tensors [b, T']."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    completion_tokens: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor

    @property
    def width(self) -> int:
        """T': completion columns of this micro-batch."""
        return int(self.completion_tokens.shape[1])

    @property
    def num_predicted(self) -> int:
        """Positions to keep at the end of the sequence: the T' that predict the completion, plus the last."""
        return self.width + 1

    def forward_kwargs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids}


def pad_groups(
    groups: Sequence[RolloutGroup], staleness: Sequence[np.ndarray], pad_id: int, first_group_id: int = 0
) -> PaddedBatch:
    """Pad whole groups into a `PaddedBatch`; `staleness[g]` is int [n_g] for group g (from `Batch.staleness`).

    Raises ValueError when there are no samples, or when staleness does not match the groups.
    """
    if len(staleness) != len(groups):
        raise ValueError(f"staleness has {len(staleness)} entries for {len(groups)} groups (one array per group)")
    samples = [(g, i) for g in groups for i in range(g.size)]
    if not samples:
        raise ValueError("no samples to train on: the batch holds no groups")
    lengths = [int(g.offsets[i + 1] - g.offsets[i]) for g, i in samples]
    width = max(max(lengths), 1)
    size = len(samples)
    tokens = torch.full((size, width), pad_id, dtype=torch.int64)
    mask = torch.zeros((size, width), dtype=torch.bool)
    behaviour = torch.zeros((size, width), dtype=torch.float32)
    for row, ((group, i), length) in enumerate(zip(samples, lengths)):
        span = slice(int(group.offsets[i]), int(group.offsets[i + 1]))
        tokens[row, :length] = torch.from_numpy(group.completion_tokens[span].astype(np.int64))
        mask[row, :length] = torch.from_numpy(group.loss_mask[span] == 1)
        behaviour[row, :length] = torch.from_numpy(group.behaviour_logprobs[span].astype(np.float32))
    behaviour = torch.where(mask, behaviour, 0.0)
    for g, (group, stale) in enumerate(zip(groups, staleness)):
        if len(stale) != group.size:
            raise ValueError(f"staleness[{g}] has {len(stale)} entries for a group of {group.size} samples")
    return PaddedBatch(
        prompts=[group.prompt_tokens for group, _ in samples],
        completion_tokens=tokens,
        completion_lengths=torch.tensor(lengths, dtype=torch.int64),
        loss_mask=mask,
        behaviour_logprobs=behaviour,
        rewards=torch.from_numpy(np.concatenate([g.rewards for g in groups]).astype(np.float32)),
        group_ids=torch.tensor([first_group_id + g for g, group in enumerate(groups) for _ in range(group.size)]),
        staleness=torch.from_numpy(np.concatenate([np.asarray(s, dtype=np.int64) for s in staleness])),
        pad_id=pad_id,
    )


def split_rows(num_rows: int, micro_steps: int) -> list[slice]:
    """`micro_steps` contiguous, nearly equal row slices covering `num_rows` (sizes differ by at most one).

    DeepSpeed's gradient accumulation expects exactly `micro_steps` backward passes per optimizer step, so the
    count is fixed and the sizes adapt. Raises ValueError when there are fewer rows than micro-steps.
    """
    if num_rows < micro_steps:
        raise ValueError(
            f"{num_rows} samples cannot fill {micro_steps} micro-batches: a rank's share of the batch is smaller "
            "than configured (learner.groups_per_step / world_size groups of algo.group_size samples)"
        )
    bounds = np.linspace(0, num_rows, micro_steps + 1).round().astype(int)
    return [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


def mini_batch_rows(num_rows: int, mini_batches: int, micro_steps: int) -> list[list[slice]]:
    """Per mini-batch (one optimizer step each), the row slices of its `micro_steps` micro-batches.

    The mini-batches are `mini_batches` contiguous equal parts of the rows, so whole groups when the groups
    divide evenly among them (groups are adjacent rows of one size). Raises ValueError when `mini_batches` does
    not divide `num_rows` or a mini-batch has fewer rows than `micro_steps`.
    """
    if num_rows % mini_batches:
        raise ValueError(
            f"{num_rows} samples cannot be split into {mini_batches} equal mini-batches: learner.mini_batches must "
            "divide a rank's share (learner.groups_per_step / world_size x algo.group_size)"
        )
    size = num_rows // mini_batches
    return [
        [slice(first + part.start, first + part.stop) for part in split_rows(size, micro_steps)]
        for first in range(0, num_rows, size)
    ]
