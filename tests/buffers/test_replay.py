"""The replay buffer: eviction oldest first by samples, FIFO and seeded uniform draws, reuse counts, whole groups."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers.replay import ReplayBuffer, choose_positions, evict_count
from tests.buffers.fakes import make_group


def test_evict_count_removes_oldest_until_it_fits() -> None:
    assert evict_count([4, 4, 4], capacity=12) == 0
    assert evict_count([4, 4, 4], capacity=11) == 1
    assert evict_count([4, 2, 8], capacity=8) == 2  # 14 -> 10 -> 8
    assert evict_count([3, 3], capacity=0) == 2


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 16), max_size=40), capacity=st.integers(0, 200))
def test_evict_count_is_the_fewest_oldest_groups(sizes: list[int], capacity: int) -> None:
    count = evict_count(sizes, capacity)
    assert sum(sizes[count:]) <= capacity
    assert count == 0 or sum(sizes[count - 1 :]) > capacity  # one fewer would not fit


def test_fifo_takes_the_oldest_and_uniform_is_seeded_and_distinct() -> None:
    rng = np.random.default_rng(0)
    assert choose_positions(10, 3, "fifo", rng) == [0, 1, 2]
    assert choose_positions(2, 3, "fifo", rng) is None
    first = choose_positions(100, 10, "uniform", np.random.default_rng(7))
    again = choose_positions(100, 10, "uniform", np.random.default_rng(7))
    other = choose_positions(100, 10, "uniform", np.random.default_rng(8))
    assert first == again and first != other
    assert len(set(first)) == 10 and all(0 <= p < 100 for p in first)
    with pytest.raises(ValueError, match="sampling"):
        choose_positions(10, 3, "lifo", rng)


def test_uniform_draws_cover_the_buffer() -> None:
    rng = np.random.default_rng(1)
    counts = np.zeros(20)
    for _ in range(2000):
        counts[choose_positions(20, 5, "uniform", rng)] += 1
    assert counts.min() > 350 and counts.max() < 650  # 500 expected each


def _buffer(capacity: int = 100, max_reuse: int = 1, sampling: str = "fifo") -> ReplayBuffer:
    replay = ReplayBuffer(capacity, max_reuse, sampling, seed=0)
    for seq in range(1, 6):
        replay.add(seq, make_group(seq, (seq, 0), size=4))
    return replay


def test_capacity_in_samples_evicts_whole_oldest_groups() -> None:
    replay = _buffer(capacity=13)  # 5 groups of 4 = 20 samples
    victims = replay.over_capacity()
    assert victims == [1, 2]
    removed = replay.remove(victims)
    assert [e.seq for e in removed] == [1, 2] and replay.samples == 12 and list(replay.entries) == [3, 4, 5]


def test_fifo_serves_oldest_and_retires_after_max_reuse() -> None:
    replay = _buffer(max_reuse=2)
    seqs = replay.choose(2)
    assert seqs == [1, 2]
    served, retired = replay.use(seqs)
    assert [e.uses for e in served] == [1, 1] and retired == [] and len(replay) == 5
    served, retired = replay.use(replay.choose(3))
    assert [e.seq for e in retired] == [1, 2] and list(replay.entries) == [3, 4, 5]
    assert replay.entries[3].uses == 1 and replay.samples == 12
    assert replay.choose(4) is None


def test_too_stale_finds_groups_with_any_old_sample() -> None:
    replay = ReplayBuffer(100, 1, "fifo", seed=0)
    replay.add(1, make_group(1, (1, 0), version=[5, 5, 5, 2]))
    replay.add(2, make_group(2, (2, 0), version=4))
    replay.add(3, make_group(3, (3, 0), version=6))
    assert replay.too_stale(step=6, max_staleness=2) == [1]
    assert replay.too_stale(step=7, max_staleness=2) == [1, 2]


def test_duplicate_seq_and_bad_settings_raise() -> None:
    replay = _buffer()
    with pytest.raises(KeyError):
        replay.add(1, make_group(1, (1, 0)))
    with pytest.raises(ValueError, match="sampling"):
        ReplayBuffer(10, 1, "lifo", 0)
