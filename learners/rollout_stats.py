"""Reward, staleness and token statistics of the global batch, from each rank's share of it.

    summary = rollout_summary(groups, staleness, max_staleness, sum_across_ranks, max_across_ranks)
    summary["reward/mean"], summary["staleness/frac_0"], summary["perf/tokens"]

Every rank calls it with its own groups (a collective when ranks > 1: all must call it); every rank gets the
statistics of the whole global batch. Staleness histogram: `staleness/frac_k` for k = 0..max_staleness, and
`staleness/frac_over` for samples beyond the bound (0 unless the buffer let one through). Completion lengths:
`perf/completion_tokens_min` and `_max`, the shortest and longest sample of the batch (model and environment
tokens after the prompt): how far a step's lengths spread, which a synchronous step waits on.

Reward components: `reward/<name>` is the mean of component `name` over the samples whose group carries it (the
raw values the generator recorded: a component of weight 0, which adds nothing to the reward, shows here all the
same, e.g. the verifier's `correct` beside `reward_model`). A component named `mean` or `std` is reported as
`reward/component_mean` / `reward/component_std`. The names are the union over every rank's groups.
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
    rank: int = 0,
    world_size: int = 1,
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
    lengths = np.concatenate([np.diff(g.offsets) for g in groups]) if groups else np.zeros(0, np.int64)
    longest, shortest = (
        (float(lengths.max()), float(lengths.min())) if len(lengths) else (0.0, np.inf)
    )  # an empty rank: no minimum
    # one reduction for three maxima: the stalest sample, the longest completion and -(the shortest one)
    peak = max_across_ranks(np.array([stale.max() if len(stale) else 0, longest, -shortest], dtype=np.float64))
    summary = {
        "reward/mean": mean,
        "reward/std": float(np.sqrt(max(total[2] / count - mean**2, 0.0))),
        "staleness/mean": total[3] / count,
        "staleness/max": float(peak[0]),
        "perf/samples": count,
        "perf/groups": total[6],
        "perf/completion_tokens": total[4],
        "perf/completion_tokens_min": -peak[2],
        "perf/completion_tokens_max": peak[1],
        "perf/tokens": total[4] + total[5],
    }
    for k in range(max_staleness + 1):
        summary[f"staleness/frac_{k}"] = total[7 + k] / count
    summary["staleness/frac_over"] = total[7 + max_staleness + 1] / count
    names = _names_across_ranks(groups, rank, world_size, sum_across_ranks, max_across_ranks)
    summary.update(_component_means(groups, names, sum_across_ranks))
    return {key: float(value) for key, value in summary.items()}


def _component_means(groups: Sequence[RolloutGroup], names: list[str], sum_across_ranks: Reduce) -> dict[str, float]:
    """reward/<name>: the mean of each component over the samples that carry it, in the whole global batch."""
    local = np.zeros(2 * len(names), dtype=np.float64)  # [count_0, sum_0, count_1, sum_1, ...]
    for group in groups:
        for i, name in enumerate(names):
            values = group.reward_components.get(name)
            if values is not None:
                local[2 * i] += len(values)
                local[2 * i + 1] += float(np.sum(values, dtype=np.float64))
    total = sum_across_ranks(local) if names else local
    means = {}
    for i, name in enumerate(names):
        key = f"reward/component_{name}" if name in ("mean", "std") else f"reward/{name}"
        means[key] = total[2 * i + 1] / total[2 * i] if total[2 * i] else 0.0
    return means


def _names_across_ranks(
    groups: Sequence[RolloutGroup], rank: int, world_size: int, sum_across_ranks: Reduce, max_across_ranks: Reduce
) -> list[str]:
    """The sorted union of the component names of every rank's groups. With ranks, an all-gather made of the two
    reductions there are: each rank writes its names (UTF-8, newline-separated) into its own row of a zero matrix
    as wide as the longest rank's text (agreed by a max), and the sum hands every rank every row."""
    local = sorted({name for group in groups for name in group.reward_components})
    if world_size == 1:
        return local
    text = "\n".join(local).encode()
    width = int(max_across_ranks(np.array([len(text)], dtype=np.float64))[0])
    if width == 0:
        return []
    rows = np.zeros((world_size, width), dtype=np.float64)  # [ranks, bytes]
    rows[rank, : len(text)] = np.frombuffer(text, dtype=np.uint8)
    gathered = sum_across_ranks(rows.ravel()).reshape(world_size, width).astype(np.uint8)
    names = {name for row in gathered for name in bytes(row).rstrip(b"\0").decode().split("\n") if name}
    return sorted(names)
