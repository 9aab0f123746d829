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

Buckets (fixed for a run): halvings of generator.max_tokens M (multi-turn: env.max_total_tokens, below), the upper
edges ⌈M / 2^k⌉ for k = 5 .. 0 (M = 64: le_2, le_4, le_8, le_16, le_32, le_64), each bucket (previous edge, edge],
the first from 0, and gt_M for what is longer than M. Log-spaced because completion lengths are skewed; the top
bucket (M/2, M] holds the truncated completions. A sample's length is its model-token count
(the sum of its loss_mask: the completion length for a single-turn sample, its own turns for an episode).

The counts are ledger events (`len_<kind>/<bucket>` in samples, `len_<kind>/tokens`, their token sum, and
`len_<kind>/truncated`, the samples whose finish reason is TRUNCATED: cut at generator.max_tokens), counted by the
state's appliers, so a restarted buffer restores them with the ledger (`buffers.state`). `trained` counts every
draw (a group served max_reuse times counts that often: the learner trains on it that often). `generated` counts
every group that passed its checks, dynamic sampling's filtered groups included (their `filtered` journal record
holds the group's `tally`, since it holds no content): what the generators produced, not what the buffer kept.
The truncated share of generated samples (`buffer/truncated_share_generated`) is the issue's "truncated share,
generated"; the learner's `rollout/truncated_share` is the trained one.

Multi-turn episodes (env.environment set). An episode's version is that of its oldest token, the first turn's, so
the longer it runs the staler it arrives: the episodes at the bound are the long ones (in tokens and in turns).
Its length is then the model tokens of the whole episode, so the edges are halvings of env.max_total_tokens, not
of generator.max_tokens (one turn's budget): `BufferSettings.max_tokens` is `TandemConfig.overlong_budget`, the
same budget the overlong penalty reads. And the episodes are counted by model turns as well, in buckets of
halvings of env.max_turns (`max_turns = 8`: le_1, le_2, le_4, le_8): ledger events `turns_<kind>/<bucket>` and
`turns_<kind>/total`, metrics `buffer/turns_<kind>/<bucket>`, `buffer/turns_<kind>_mean` and
`buffer/turns_drop_rate_shortest|longest`, beside the length ones (none when max_turns = 0: single-turn runs).
A sample's turns are the runs of model tokens in its loss mask (`sample_turns`): the episode driver
(`actors.environments.episodes`) appends a turn's sampled tokens (at least one) and, before the next turn, the environment's
rendered observation, whose chat-template delta opens the next assistant turn (at least its generation prompt),
so consecutive turns are always separated by environment tokens and the count needs nothing new on the wire.
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


def sample_turns(group: RolloutGroup) -> np.ndarray:
    """int64 [n]: the model turns of each sample, the maximal runs of loss_mask = 1 within its slice (module
    docstring: the episode driver separates turns with environment tokens). A single-turn sample has 1 (0 if
    empty); a run is counted in the sample where it starts, and a sample's slice never starts inside a run of the
    previous one because runs are cut at the offsets."""
    mask = group.loss_mask.astype(bool)
    starts = mask.copy()
    starts[1:] &= ~mask[:-1]  # a model token whose predecessor is not one opens a turn
    heads = group.offsets[:-1][group.offsets[:-1] < len(mask)]  # each non-empty sample's first token
    starts[heads] = mask[heads]  # ... opens a turn if it is a model token, whatever the previous sample ended with
    cumulative = np.concatenate(([0], np.cumsum(starts, dtype=np.int64)))
    return cumulative[group.offsets[1:]] - cumulative[group.offsets[:-1]]


def bucket_counts(lengths: np.ndarray, edges: list[int]) -> np.ndarray:
    """int64 [len(edges) + 1]: how many lengths fall in each bucket (edges[i-1], edges[i]], the last > edges[-1]."""
    return np.bincount(np.searchsorted(edges, lengths, side="left"), minlength=len(edges) + 1)


class LengthCounts:
    """Counts samples by length bucket into the ledger, per kind (generated, trained, dropped_stale), and with
    `max_turns` > 0 (a multi-turn run: env.max_turns) by turn bucket as well."""

    def __init__(self, ledger: Ledger, max_tokens: int, max_turns: int = 0) -> None:
        self.ledger = ledger
        self.edges = length_edges(max_tokens)
        self.names = bucket_names(self.edges)
        self.turn_edges = length_edges(max_turns) if max_turns else []
        self.turn_names = bucket_names(self.turn_edges) if max_turns else []

    def tally(self, group: RolloutGroup) -> dict[str, int]:
        """What `count` adds for one group: its samples per bucket (the non-empty buckets), `tokens` (their sum),
        `truncated` (samples with finish reason TRUNCATED) and, counting turns, `turns/<bucket>` and `turns/total`.
        Plain ints, so a journal record can hold it."""
        lengths = sample_lengths(group)
        out = {name: int(n) for name, n in zip(self.names, bucket_counts(lengths, self.edges)) if n}
        out["tokens"] = int(lengths.sum())
        out["truncated"] = sum(reason == TRUNCATED for reason in group.finish_reasons)
        if self.turn_edges:
            turns = sample_turns(group)
            per_bucket = zip(self.turn_names, bucket_counts(turns, self.turn_edges))
            out.update({f"turns/{name}": int(n) for name, n in per_bucket if n})
            out["turns/total"] = int(turns.sum())
        return out

    def add(self, kind: str, tally: Mapping[str, int]) -> None:
        """Count one group's `tally` under `kind`: `len_<kind>/<key>`, `turns_<kind>/<bucket>` for a `turns/` key
        (a zero count adds no key, as `count` never did; a tally journaled before turns were counted adds none)."""
        if kind not in KINDS:
            raise KeyError(f"{kind!r} is not a length kind (one of {KINDS})")
        for key, value in tally.items():
            if value or key in ("tokens", "turns/total"):
                turns = key.startswith("turns/")
                event = f"turns_{kind}/{key.removeprefix('turns/')}" if turns else f"len_{kind}/{key}"
                self.ledger.event(event, int(value))

    def count(self, kind: str, groups: Iterable[RolloutGroup]) -> None:
        for group in groups:
            self.add(kind, self.tally(group))


def length_metrics(
    counts: Mapping[str, int], edges: list[int], turn_edges: list[int] | None = None
) -> dict[str, float]:
    """`buffer/len_<kind>/<bucket>` for every bucket (0 where none yet), the mean length and the truncated share of
    each kind that has samples (`buffer/len_<kind>_mean`, `buffer/truncated_share_<kind>`), and the drop rate
    (samples dropped as stale / generated) of the shortest and of the longest bucket that has generated samples
    (`buffer/len_drop_rate_shortest`, `..._longest`). With `turn_edges` (`LengthCounts.turn_edges` of a multi-turn
    run) the same by turns: `buffer/turns_<kind>/<bucket>`, `buffer/turns_<kind>_mean`, `buffer/turns_drop_rate_*`."""
    values = _histograms(counts, "len", "tokens", edges)
    for kind in KINDS:
        samples = sum(int(counts.get(f"len_{kind}/{name}", 0)) for name in bucket_names(edges))
        if samples:
            values[f"buffer/truncated_share_{kind}"] = counts.get(f"len_{kind}/truncated", 0) / samples
    if turn_edges:
        values.update(_histograms(counts, "turns", "total", turn_edges))
    return values


def _histograms(counts: Mapping[str, int], prefix: str, total: str, edges: list[int]) -> dict[str, float]:
    """Per kind, `buffer/<prefix>_<kind>/<bucket>` and the mean (`<prefix>_<kind>/<total>` over the samples), and
    the drop rates of the shortest and longest filled buckets (`buffer/<prefix>_drop_rate_shortest|longest`)."""
    names = bucket_names(edges)
    values: dict[str, float] = {}
    for kind in KINDS:
        per_bucket = [int(counts.get(f"{prefix}_{kind}/{name}", 0)) for name in names]
        values.update({f"buffer/{prefix}_{kind}/{name}": count for name, count in zip(names, per_bucket)})
        if sum(per_bucket):
            values[f"buffer/{prefix}_{kind}_mean"] = counts.get(f"{prefix}_{kind}/{total}", 0) / sum(per_bucket)
    filled = [name for name in names if counts.get(f"{prefix}_generated/{name}", 0)]
    if filled:
        for which, name in (("shortest", filled[0]), ("longest", filled[-1])):
            dropped = counts.get(f"{prefix}_dropped_stale/{name}", 0)
            values[f"buffer/{prefix}_drop_rate_{which}"] = dropped / counts[f"{prefix}_generated/{name}"]
    return values
