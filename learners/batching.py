"""Rollout groups -> padded tensors, and the micro-batches one update is split into.

    batch = pad_groups(groups, staleness, pad_id, first_group_id=rank * len(groups))
    for mini in mini_batch_rows(batch.size, mini_batches, micro_steps):   # one optimizer step per mini-batch
        for rows in mini:                                     # contiguous row slices, micro_steps of them
            inputs = batch.model_inputs(rows, device)         # prompt + completion, padded for this micro-batch
            out = model(**inputs.forward_kwargs(), logits_to_keep=inputs.keep, use_cache=False).logits
            logits = inputs.predicting(out)                   # [b, T', V]: what predicts each completion token

Layout (B samples, T = the longest completion of the batch):
  * Completion tensors are [B, T], right-padded: completion token t of sample b is `completion_tokens[b, t]`;
    `loss_mask[b, t]` is 1 only on action tokens (the group's loss_mask) inside the completion.
  * A micro-batch's model input is [b, P + T'] with P its longest prompt and T' its longest completion: prompts
    are LEFT-padded, so every completion starts at column P, and completions right-padded. position_ids count
    real tokens only (a sample sees the positions it would see unpadded). The logits that predict the
    completion are the last T' + 1 positions minus the last one (`ModelInputs.num_predicted` = T' + 1).
  * Samples of one group are adjacent and keep the group's order; `group_ids` are `first_group_id + index`.
  * Packed (`model_inputs(rows, device, packed=True)`): the micro-batch's samples, each prompt then completion
    with no padding, are placed whole (first-fit decreasing) in r rows of width W = its longest sample; a row's
    unused tail is padding. position_ids restart at 0 for each sample (and for the tail), attention_mask is None:
    transformers (masking_utils.find_packed_sequence_indices, when there is no 2D mask and no cache) then builds
    a causal mask that is block-diagonal per sample for sdpa/eager. Rows stay no wider than the longest sample
    (that attention is quadratic in W). flash-attention takes the same position_ids as varlen boundaries, but
    only in a batch of one row: `one_row` lays the rows end to end for it (not tested here: no GPU).
  * Either way `ModelInputs.predicting(out)` reads a per-position model output at the positions that predict each
    completion token ([b, T'] from [r, K]), and `ModelInputs.keep` is what to pass as logits_to_keep.

Micro-batches: `mini_batch_rows` (micro_batch_size sequences each), or `token_budget_micro_batches` (prompt +
completion tokens <= learner.max_tokens_per_micro_batch, padding not counted; a sample over the budget alone),
evened across ranks with `split_to_count`.
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

    def sample_tokens(self) -> torch.Tensor:
        """int64 [B]: prompt + completion tokens of each sample (what `max_tokens_per_micro_batch` counts)."""
        return torch.tensor([len(p) for p in self.prompts]) + self.completion_lengths

    def model_inputs(
        self, rows: Rows, device: torch.device, packed: bool = False, one_row: bool = False
    ) -> ModelInputs:
        """The model input of rows `rows` on `device`: padded (see the module docstring), or `packed` (in one
        row with `one_row`, as flash-attention's varlen path needs)."""
        if packed:
            return self.packed_inputs(rows, device, one_row)
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
            real_tokens=int(attention_mask.sum()),
        )

    def packed_inputs(self, rows: Rows, device: torch.device, one_row: bool = False) -> ModelInputs:
        """Rows `rows` packed: each sample (prompt then completion, unpadded) placed whole in a row of width W =
        the longest sample's prompt + completion (first-fit decreasing), position_ids 0.. per sample, the row's
        unused tail padding with positions of its own; attention_mask None, so the model's mask keeps every
        sample to itself (module docstring) -- call the model with use_cache=False: transformers derives that
        mask only without a cache, and with one silently lets samples see each other. `one_row`: the r rows
        laid end to end as one [1, r W] row (transformers' flash-attention finds packed samples only in a batch
        of one row; its varlen kernel's cost is per sample, so the width costs nothing there). Completion-aligned
        tensors stay [b, T'] in `rows` order."""
        index = torch.arange(self.size)[rows].tolist()
        prompts = [self.prompts[i] for i in index]
        lengths = [int(self.completion_lengths[i]) for i in index]
        totals = [len(p) + n for p, n in zip(prompts, lengths)]
        row_width = max(totals)
        placement = first_fit_decreasing(totals, row_width)  # rows of sample positions j (into `index`)
        input_ids = torch.full((len(placement), row_width), self.pad_id, dtype=torch.int64)
        position_ids = torch.zeros_like(input_ids)
        width = max(max(lengths), 1)
        predict_rows = torch.zeros((len(index), width), dtype=torch.int64)
        predict_cols = torch.zeros_like(predict_rows)
        for r, members in enumerate(placement):
            start = 0
            for j in members:
                prompt, n = prompts[j], lengths[j]
                end = start + len(prompt) + n
                input_ids[r, start : start + len(prompt)] = torch.from_numpy(prompt.astype(np.int64))
                input_ids[r, start + len(prompt) : end] = self.completion_tokens[index[j], :n]
                position_ids[r, start:end] = torch.arange(end - start)
                predict_rows[j] = r
                predict_cols[j, :n] = torch.arange(start + len(prompt) - 1, end - 1)  # position t predicts t + 1
                predict_cols[j, n:] = start  # past the completion: any valid position (masked out)
                start = end
            position_ids[r, start:] = torch.arange(row_width - start)  # the tail: a sequence of its own
        if one_row:
            predict_cols += predict_rows * row_width
            predict_rows.zero_()
            input_ids, position_ids = input_ids.reshape(1, -1), position_ids.reshape(1, -1)
        return ModelInputs(
            input_ids=input_ids.to(device),
            attention_mask=None,
            position_ids=position_ids.to(device),
            completion_tokens=self.completion_tokens[rows, :width].to(device),
            loss_mask=self.loss_mask[rows, :width].to(device),
            behaviour_logprobs=self.behaviour_logprobs[rows, :width].to(device),
            real_tokens=sum(totals),
            predictors=(predict_rows.to(device), predict_cols.to(device)),
        )


@dataclass
class ModelInputs:
    """One micro-batch: model input [r, L] (padded: r = b rows of P + T'; packed: r rows of the longest sample)
    and the completion-aligned tensors [b, T'] (b samples, T' their longest completion)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None  # None when packed: the mask comes from the restarting position_ids
    position_ids: torch.Tensor
    completion_tokens: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    real_tokens: int = 0  # prompt + completion tokens in the input (the rest of input_ids.numel() is padding)
    predictors: tuple[torch.Tensor, torch.Tensor] | None = None  # packed: (row, column) [b, T'] predicting each token

    @property
    def keep(self) -> int:
        """What to pass as `logits_to_keep` / `values_to_keep`: the last `num_predicted` positions (padded), or
        0 = every position (packed: the predicting positions are spread over the rows)."""
        return 0 if self.predictors is not None else self.num_predicted

    def predicting(self, out: torch.Tensor) -> torch.Tensor:
        """[b, T', ...]: the entries of a per-position model output `out` [r, K, ...] (K = the kept positions, or
        all of them) at the position that predicts each completion token (0 <= t < T')."""
        if self.predictors is None:
            return out[:, -self.num_predicted : -1]
        rows, cols = self.predictors
        return out[rows, cols]

    @property
    def positions(self) -> int:
        """Positions the forward processes (padding included)."""
        return int(self.input_ids.numel())

    @property
    def width(self) -> int:
        """T': completion columns of this micro-batch."""
        return int(self.completion_tokens.shape[1])

    @property
    def num_predicted(self) -> int:
        """Positions to keep at the end of the sequence: the T' that predict the completion, plus the last."""
        return self.width + 1

    def forward_kwargs(self) -> dict[str, torch.Tensor | None]:
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


def first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices into `sizes` in bins of total size <= `capacity` (first-fit decreasing; a size over the capacity
    gets a bin of its own). Within a bin, larger sizes first; ties keep index order."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        fit = next((k for k, load in enumerate(loads) if load + sizes[i] <= capacity), None)
        if fit is None:
            bins.append([i])
            loads.append(sizes[i])
        else:
            bins[fit].append(i)
            loads[fit] += sizes[i]
    return bins


def next_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Like `first_fit_decreasing`, but each bin is a run of the sizes sorted in decreasing order (a new bin
    when the next does not fit): neighbours in length share a bin, so padding them to their longest wastes
    little (the padded layout)."""
    bins: list[list[int]] = []
    load = 0
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if bins and load + sizes[i] <= capacity:
            bins[-1].append(i)
            load += sizes[i]
        else:
            bins.append([i])
            load = sizes[i]
    return bins


def token_budget_micro_batches(tokens: torch.Tensor, rows: slice, budget: int, packed: bool) -> list[torch.Tensor]:
    """The micro-batches of mini-batch `rows` by token count: int64 row indices each, with prompt + completion
    tokens (`tokens` [B], padding not counted) summing to <= `budget`; a sample over the budget is alone.
    Packed: first-fit decreasing (any lengths share a micro-batch); padded: next-fit decreasing."""
    sizes = tokens[rows].tolist()
    bins = (first_fit_decreasing if packed else next_fit_decreasing)(sizes, budget)
    return [torch.tensor(sorted(b), dtype=torch.int64) + rows.start for b in bins]


def split_to_count(micro_batches: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """`micro_batches` split until there are `count` of them (the one with the most rows halved each time), so
    that every data-parallel rank runs the same number of micro-steps. Splitting keeps each within its budget.
    Raises ValueError when there are fewer rows than `count`."""
    parts = list(micro_batches)
    if sum(len(p) for p in parts) < count:
        raise ValueError(f"{sum(len(p) for p in parts)} samples cannot fill {count} micro-batches")
    while len(parts) < count:
        k = max(range(len(parts)), key=lambda i: len(parts[i]))
        half = (len(parts[k]) + 1) // 2
        parts[k : k + 1] = [parts[k][:half], parts[k][half:]]
    return parts
