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
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from buffers.staleness import stale_positions
from common.types import RolloutGroup

SAMPLING_MODES = ("fifo", "uniform")


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


def choose_positions(available: int, count: int, sampling: str, rng: np.random.Generator) -> list[int] | None:
    """Positions (in arrival order) of `count` distinct groups out of `available`, or None if too few.

    fifo: the oldest `count`; uniform: `count` drawn without replacement by `rng` (seeded by the caller).
    """
    if sampling not in SAMPLING_MODES:
        raise ValueError(f"sampling: must be one of {SAMPLING_MODES} (got {sampling!r})")
    if count < 1:
        raise ValueError(f"count: must be >= 1 group (got {count})")
    if available < count:
        return None
    if sampling == "fifo":
        return list(range(count))
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
        positions = choose_positions(len(self.entries), count, self.sampling, self.rng)
        if positions is None:
            return None
        seqs = list(self.entries) if self.sampling == "uniform" else list(itertools.islice(self.entries, count))
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
