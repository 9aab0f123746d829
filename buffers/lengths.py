"""Completion lengths generated, trained and dropped as too stale, by length bucket: does the staleness bound bias
training toward short answers?

    lengths = LengthCounts(ledger, max_tokens=64)     # buckets le_2, le_4, ..., le_64, gt_64
    lengths.count("generated", [group])              # at arrival (BufferState._apply_group)
    lengths.count("dropped_stale", groups)           # dropped at draw time (BufferState._apply_drop)
    lengths.count("trained", groups)                 # drawn into a batch (BufferState._apply_draw)
    values = length_metrics(ledger.counts, lengths.edges)   # buffer/len_* for the metrics sink

Where the bias comes from. A generator pushes a group when its last sample finishes, so a group of long completions
arrives after the short groups leased with it or after it, and it carries the policy version of the weights it
started with: older than that of the short groups that arrive beside it. Admission (`buffers.staleness`) keeps
every group within η only if groups are consumed in admission order; `buffer.sampling = "fifo"` consumes them in
arrival order, so short groups admitted after a long one are trained first, the long one waits behind them, and
the draw of the first step s with s - v > η drops it (`uniform` ignores age altogether and does no better). Leases,
admission and the drop rule never look at lengths; the lateness of long groups alone puts them at the bound. So
the drops fall on long answers, and what is trained is shorter than what was generated. `buffer.sampling =
"oldest_first"` (`buffers.replay.draw_order_key`) draws the oldest policy version first among the groups still
within η, ties in lease (admission) order, never in arrival order: a group near the bound is trained before it
expires, ahead of younger groups that can still wait.

Buckets (fixed for a run): halvings of generator.max_tokens M, the upper edges ⌈M / 2^k⌉ for k = 5 .. 0
(M = 64: le_2, le_4, le_8, le_16, le_32, le_64), each bucket (previous edge, edge], the first from 0, and gt_M
for what is longer than M (multi-turn episodes: max_tokens bounds one turn). Log-spaced because completion lengths
are skewed; the top bucket (M/2, M] holds the truncated completions. A sample's length is its model-token count
(the sum of its loss_mask: the completion length for a single-turn sample, its own turns for an episode).

The counts are ledger events (`len_<kind>/<bucket>` in samples, `len_<kind>/tokens`, their token sum, and
`len_<kind>/truncated`, the samples whose finish reason is TRUNCATED: cut at generator.max_tokens), counted by the
state's appliers, so a restarted buffer restores them with the ledger (`buffers.state`). `trained` counts every
draw (a group served max_reuse times counts that often: the learner trains on it that often). `generated` counts
every group that passed its checks, dynamic sampling's filtered groups included (their `filtered` journal record
holds the group's `tally`, since it holds no content): what the generators produced, not what the buffer kept.
The truncated share of generated samples (`buffer/truncated_share_generated`) is the issue's "truncated share,
generated"; the learner's `rollout/truncated_share` is the trained one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from buffers.accounting import Ledger
from common.eval_metrics import TRUNCATED
from common.types import RolloutGroup

NUM_BUCKETS = 6  # edges M/32 .. M: on the demo's M = 64 the first bucket holds 0-2 tokens
KINDS = ("generated", "trained", "dropped_stale")


def length_edges(max_tokens: int, buckets: int = NUM_BUCKETS) -> list[int]:
    """Upper bucket edges ⌈M / 2^k⌉ for k = buckets - 1 .. 0, ascending, repeats removed (M = 5: [1, 2, 3, 5])."""
    if max_tokens < 1 or buckets < 1:
        raise ValueError(f"max_tokens and buckets must be >= 1 (got {max_tokens}, {buckets})")
    return sorted({math.ceil(max_tokens / 2**k) for k in range(buckets)})


def bucket_names(edges: list[int]) -> list[str]:
    """`le_<edge>` for each edge, then `gt_<last edge>`."""
    return [f"le_{edge}" for edge in edges] + [f"gt_{edges[-1]}"]


def sample_lengths(group: RolloutGroup) -> np.ndarray:
    """int64 [n]: the model tokens of each sample (loss_mask summed over its slice of the completion)."""
    cumulative = np.concatenate(([0], np.cumsum(group.loss_mask, dtype=np.int64)))
    return cumulative[group.offsets[1:]] - cumulative[group.offsets[:-1]]


def bucket_counts(lengths: np.ndarray, edges: list[int]) -> np.ndarray:
    """int64 [len(edges) + 1]: how many lengths fall in each bucket (edges[i-1], edges[i]], the last > edges[-1]."""
    return np.bincount(np.searchsorted(edges, lengths, side="left"), minlength=len(edges) + 1)


class LengthCounts:
    """Counts samples by length bucket into the ledger, per kind (generated, trained, dropped_stale)."""

    def __init__(self, ledger: Ledger, max_tokens: int) -> None:
        self.ledger = ledger
        self.edges = length_edges(max_tokens)
        self.names = bucket_names(self.edges)

    def tally(self, group: RolloutGroup) -> dict[str, int]:
        """What `count` adds for one group: its samples per bucket (the non-empty buckets), `tokens` (their sum) and
        `truncated` (samples with finish reason TRUNCATED). Plain ints, so a journal record can hold it."""
        lengths = sample_lengths(group)
        out = {name: int(n) for name, n in zip(self.names, bucket_counts(lengths, self.edges)) if n}
        out["tokens"] = int(lengths.sum())
        out["truncated"] = sum(reason == TRUNCATED for reason in group.finish_reasons)
        return out

    def add(self, kind: str, tally: Mapping[str, int]) -> None:
        """Count one group's `tally` under `kind` (a zero count adds no key, as `count` never did)."""
        if kind not in KINDS:
            raise KeyError(f"{kind!r} is not a length kind (one of {KINDS})")
        for key, value in tally.items():
            if value or key == "tokens":
                self.ledger.event(f"len_{kind}/{key}", int(value))

    def count(self, kind: str, groups: Iterable[RolloutGroup]) -> None:
        for group in groups:
            self.add(kind, self.tally(group))


def length_metrics(counts: Mapping[str, int], edges: list[int]) -> dict[str, float]:
    """`buffer/len_<kind>/<bucket>` for every bucket (0 where none yet), the mean length and the truncated share of
    each kind that has samples (`buffer/len_<kind>_mean`, `buffer/truncated_share_<kind>`), and the drop rate (samples dropped as stale / generated) of the shortest and
    of the longest bucket that has generated samples (`buffer/len_drop_rate_shortest`, `..._longest`)."""
    names = bucket_names(edges)
    values: dict[str, float] = {}
    for kind in KINDS:
        per_bucket = [int(counts.get(f"len_{kind}/{name}", 0)) for name in names]
        values.update({f"buffer/len_{kind}/{name}": count for name, count in zip(names, per_bucket)})
        if sum(per_bucket):
            values[f"buffer/len_{kind}_mean"] = counts.get(f"len_{kind}/tokens", 0) / sum(per_bucket)
            values[f"buffer/truncated_share_{kind}"] = counts.get(f"len_{kind}/truncated", 0) / sum(per_bucket)
    filled = [name for name in names if counts.get(f"len_generated/{name}", 0)]
    if filled:
        for which, name in (("shortest", filled[0]), ("longest", filled[-1])):
            dropped = counts.get(f"len_dropped_stale/{name}", 0)
            values[f"buffer/len_drop_rate_{which}"] = dropped / counts[f"len_generated/{name}"]
    return values
