"""Reward, staleness and token statistics of the global batch, from each rank's share of it.

    summary = rollout_summary(groups, staleness, max_staleness, sum_across_ranks, max_across_ranks)
    summary["reward/mean"], summary["staleness/frac_0"], summary["perf/tokens"]

Every rank calls it with its own groups (a collective when ranks > 1: all must call it); every rank gets the
statistics of the whole global batch. Staleness histogram: `staleness/frac_k` for k = 0..max_staleness, and
`staleness/frac_over` for samples beyond the bound (0 unless the buffer let one through).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from common.types import RolloutGroup

Reduce = Callable[[np.ndarray], np.ndarray]


def _identity(values: np.ndarray) -> np.ndarray:
    return values


def rollout_summary(
    groups: Sequence[RolloutGroup],
    staleness: Sequence[np.ndarray],
    max_staleness: int,
    sum_across_ranks: Reduce = _identity,
    max_across_ranks: Reduce = _identity,
) -> dict[str, float]:
    """Statistics of the global batch (see the module docstring). Raises ValueError for an empty batch."""
    rewards = np.concatenate([g.rewards for g in groups]).astype(np.float64) if groups else np.zeros(0)
    stale = np.concatenate([np.asarray(s, dtype=np.int64) for s in staleness]) if groups else np.zeros(0, np.int64)
    hist = np.bincount(np.clip(stale, 0, max_staleness + 1), minlength=max_staleness + 2)[: max_staleness + 2]
    completion = float(sum(g.num_tokens for g in groups))
    prompt = float(sum(len(g.prompt_tokens) * g.size for g in groups))
    local = np.array(
        [len(rewards), rewards.sum(), (rewards**2).sum(), stale.sum(), completion, prompt, len(groups), *hist],
        dtype=np.float64,
    )
    total = sum_across_ranks(local)
    count = total[0]
    if count == 0:
        raise ValueError("no samples in the global batch: nothing to summarise")
    mean = total[1] / count
    peak = max_across_ranks(np.array([stale.max() if len(stale) else 0], dtype=np.float64))
    summary = {
        "reward/mean": mean,
        "reward/std": float(np.sqrt(max(total[2] / count - mean**2, 0.0))),
        "staleness/mean": total[3] / count,
        "staleness/max": float(peak[0]),
        "perf/samples": count,
        "perf/groups": total[6],
        "perf/completion_tokens": total[4],
        "perf/tokens": total[4] + total[5],
    }
    for k in range(max_staleness + 1):
        summary[f"staleness/frac_{k}"] = total[7 + k] / count
    summary["staleness/frac_over"] = total[7 + max_staleness + 1] / count
    return {key: float(value) for key, value in summary.items()}
