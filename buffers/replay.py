"""The replay buffer: complete groups in arrival order, a capacity in samples, a reuse count per group.

    replay = ReplayBuffer(capacity=4096, max_reuse=1, sampling="fifo", seed=0)
    replay.add(seq, group)                       # seq: the buffer's arrival number of the group
    victims = replay.remove(replay.over_capacity())   # oldest first, until the rest fits
    stale = replay.remove(replay.too_stale(step, max_staleness))
    chosen = replay.choose(num_groups)           # None while fewer groups are buffered
    retired = replay.use(chosen)                 # served once more; those used max_reuse times leave

Invariants: groups are kept whole (a group is one entry); `samples` is the sum of the entries' sizes; an entry
leaves only through `remove` (evicted, dropped) or `use` (retired after its last use). The decisions (which to
evict, which to draw) are pure functions below, so they are tested without the class.

Sampling modes (buffer.sampling): `fifo` draws in arrival order, `uniform` at random (seeded), `oldest_first` by
`draw_order_key`: the oldest policy version first, ties in lease order. Why oldest_first: a group of long completions
finishes last, so it arrives after younger, shorter groups and with an older version; fifo trains those first and
the long group reaches the staleness bound and is dropped (`buffers.lengths` measures it). Drawing the oldest
version first is earliest-deadline-first (a group of version v may be trained up to step v + η): among the groups
still within η (the drop rule runs first), the ones closest to the bound are trained before younger ones that can
wait, so a group is dropped only when more than a batch of groups reach their last step together, and which of
those wait is decided by lease order, which is fixed before any length is known. It keeps the contracts: the drop rule
still holds η, draws still take whole groups of the buffer and count uses (max_reuse, the ledger), and the order is
a function of the buffered groups alone (no random draw), so a journal replay or a rerun draws the same batches.
It trains older samples than fifo would (the staleness mean rises, within η), which is what not dropping them means.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from buffers.staleness import stale_positions
from common.types import RolloutGroup

SAMPLING_MODES = ("fifo", "uniform", "oldest_first")


def evict_count(sizes_oldest_first: Iterable[int], capacity: int, total: int | None = None) -> int:
    """How many of the oldest groups must leave so that the rest hold at most `capacity` samples.

    `total` (the sum of all sizes) lets the sizes be a lazy iterator that is read only as far as needed."""
    if total is None:
        sizes_oldest_first = list(sizes_oldest_first)
        total = sum(sizes_oldest_first)
    excess, count = total - capacity, 0
    sizes = iter(sizes_oldest_first)
    while excess > 0:
        excess -= next(sizes)
        count += 1
    return count


def draw_order_key(group: RolloutGroup) -> tuple[int, int, int]:
    """oldest_first's order: (oldest policy version, lease id, prompt id). Lease ids grow in grant order, so ties
    fall in admission order, not in arrival order (which favours short completions); (lease, prompt) is unique."""
    return (group.min_version(), group.lease_id, group.prompt_id)


def choose_positions(
    available: int,
    count: int,
    sampling: str,
    rng: np.random.Generator,
    keys: Sequence[tuple[int, ...]] | None = None,
) -> list[int] | None:
    """Positions (in arrival order) of `count` distinct groups out of `available`, or None if too few.

    fifo: the oldest `count`; uniform: `count` drawn without replacement by `rng` (seeded by the caller);
    oldest_first: the `count` smallest `keys` (one per group, `draw_order_key`), smallest first.
    """
    if sampling not in SAMPLING_MODES:
        raise ValueError(f"sampling: must be one of {SAMPLING_MODES} (got {sampling!r})")
    if count < 1:
        raise ValueError(f"count: must be >= 1 group (got {count})")
    if available < count:
        return None
    if sampling == "fifo":
        return list(range(count))
    if sampling == "oldest_first":
        if keys is None or len(keys) != available:
            raise ValueError(f"oldest_first: needs one key per buffered group ({available}), got {keys!r:.80}")
        return sorted(range(available), key=keys.__getitem__)[:count]
    return [int(i) for i in rng.choice(available, size=count, replace=False)]


@dataclass
class Entry:
    """One buffered group: its arrival number, the group, and how often it was served so far."""

    seq: int
    group: RolloutGroup
    uses: int = 0

    @property
    def samples(self) -> int:
        return self.group.size

    @property
    def oldest_version(self) -> int:
        return self.group.min_version()


class ReplayBuffer:
    """Groups in arrival order with a capacity in samples and a reuse limit; not thread-safe."""

    def __init__(self, capacity: int, max_reuse: int, sampling: str, seed: int) -> None:
        if capacity < 1 or max_reuse < 1:
            raise ValueError(f"capacity and max_reuse must be >= 1 (got {capacity}, {max_reuse})")
        if sampling not in SAMPLING_MODES:
            raise ValueError(f"buffer.sampling: must be one of {SAMPLING_MODES} (got {sampling!r})")
        self.capacity = capacity
        self.max_reuse = max_reuse
        self.sampling = sampling
        self.rng = np.random.default_rng(seed)
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.samples = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, seq: int) -> bool:
        return seq in self.entries

    def add(self, seq: int, group: RolloutGroup, uses: int = 0) -> Entry:
        """Append a group (newest last). Capacity is not enforced here: call `over_capacity` after."""
        if seq in self.entries:
            raise KeyError(f"group seq {seq} is already buffered")
        entry = Entry(seq, group, uses)
        self.entries[seq] = entry
        self.samples += entry.samples
        return entry

    def over_capacity(self) -> list[int]:
        """Seqs of the oldest groups that must be evicted for the rest to fit the capacity."""
        if self.samples <= self.capacity:
            return []
        count = evict_count((entry.samples for entry in self.entries.values()), self.capacity, self.samples)
        return list(itertools.islice(self.entries, count))

    def too_stale(self, step: int, max_staleness: int) -> list[int]:
        """Seqs of the groups with a sample older than `max_staleness` versions at `step`."""
        seqs = list(self.entries)
        oldest = [self.entries[s].oldest_version for s in seqs]
        return [seqs[i] for i in stale_positions(step, oldest, max_staleness)]

    def choose(self, count: int) -> list[int] | None:
        """Seqs of `count` groups to serve (by the sampling mode), or None while fewer are buffered."""
        keys = None
        if self.sampling == "oldest_first":
            keys = [draw_order_key(entry.group) for entry in self.entries.values()]
        positions = choose_positions(len(self.entries), count, self.sampling, self.rng, keys)
        if positions is None:
            return None
        seqs = list(itertools.islice(self.entries, count)) if self.sampling == "fifo" else list(self.entries)
        return [seqs[p] for p in positions]

    def remove(self, seqs: Iterable[int]) -> list[Entry]:
        """Take these groups out (evicted or dropped); unknown seqs raise KeyError."""
        removed = [self.entries.pop(seq) for seq in seqs]
        self.samples -= sum(entry.samples for entry in removed)
        return removed

    def use(self, seqs: Sequence[int]) -> tuple[list[Entry], list[Entry]]:
        """Serve these groups once more: (served entries, retired entries that reached max_reuse and left)."""
        served = [self.entries[seq] for seq in seqs]
        for entry in served:
            entry.uses += 1
        retired = [entry for entry in served if entry.uses >= self.max_reuse]
        self.remove(entry.seq for entry in retired)
        return served, retired
