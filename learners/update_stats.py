"""What one update measures, summed over its micro-batches and data-parallel ranks (used by `learners.trainer`).

    stats = GlobalAverages()
    stats.add("loss/policy", loss, weight=loss_share)        # weights of all micro-batches of all ranks sum to 1
    stats.peak("policy/iw_max", iw_max)
    metrics = stats.across_ranks(sum_ranks, max_ranks)       # a collective: every rank, the same names
    shape = InputShape(); shape.add(inputs)                  # padding and tokens of every forward
    metrics |= shape.metrics(sum_ranks, max_ranks)

`aggregate` and `loss_units` are the two halves of the loss aggregation (`learners.losses`): the per-token mean
it takes, and what it divides by, so that a micro-batch's loss can be weighted by its share of the global units.
Failure mode: `across_ranks` and `metrics` are collectives; a rank that records different names hangs the others.
"""

from __future__ import annotations

import math
import resource

import numpy as np
import torch

from learners.batching import ModelInputs
from learners.rollout_stats import Reduce


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Like `losses.policy_loss`'s aggregation: token_mean over action tokens, or seq_mean over non-empty rows."""
    per_token = torch.where(mask, per_token, 0)
    if aggregation == "token_mean":
        return per_token.sum() / mask.sum().clamp(min=1)
    counts = mask.sum(dim=1)
    return (per_token.sum(dim=1) / counts.clamp(min=1)).sum() / (counts > 0).sum().clamp(min=1)


def loss_units(mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """What the aggregation divides by: action tokens (token_mean) or rows with >= 1 action token (seq_mean)."""
    return (mask.sum() if aggregation == "token_mean" else mask.any(dim=1).sum()).double()


class GlobalAverages:
    """Statistics of the global batch from per-micro-batch values: weighted sums (a micro-batch's weight is its
    share of the global loss units or action tokens, so the weights of all ranks add up to 1) and maxima."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.peaks: dict[str, float] = {}

    def add(self, name: str, value: torch.Tensor, weight: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(value.detach()) * weight

    def peak(self, name: str, value: torch.Tensor) -> None:
        self.peaks[name] = max(self.peaks.get(name, -math.inf), float(value))

    def across_ranks(self, sum_ranks: Reduce, max_ranks: Reduce) -> dict[str, float]:
        """The global values (a collective: every rank must call it with the same names)."""
        sums, peaks = sorted(self.sums), sorted(self.peaks)
        totals = sum_ranks(np.array([self.sums[k] for k in sums], dtype=np.float64))
        maxima = max_ranks(np.array([self.peaks[k] for k in peaks], dtype=np.float64))
        return {**dict(zip(sums, totals.tolist())), **dict(zip(peaks, maxima.tolist()))}


class InputShape:
    """What the update's forwards processed (summed over ranks): padding fraction and tokens per micro-batch."""

    def __init__(self) -> None:
        self.counts = np.zeros(3)  # positions, real tokens, micro-batches

    def add(self, inputs: ModelInputs) -> None:
        self.counts += (inputs.positions, inputs.real_tokens, 1)

    def metrics(self, sum_ranks: Reduce, max_ranks: Reduce) -> dict[str, float]:
        """`perf/padding_fraction`: padded positions / all positions of the update's forwards; `perf/
        tokens_per_micro_batch`: prompt + completion tokens per micro-batch (mean); `perf/peak_rss_mb`: this
        process's peak resident memory so far (getrusage ru_maxrss, the largest over ranks). A collective."""
        positions, real, micro_batches = sum_ranks(self.counts).tolist()
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        return {
            "perf/padding_fraction": 1.0 - real / max(positions, 1.0),
            "perf/tokens_per_micro_batch": real / max(micro_batches, 1.0),
            "perf/peak_rss_mb": float(max_ranks(np.array([peak_mb]))[0]),
        }
