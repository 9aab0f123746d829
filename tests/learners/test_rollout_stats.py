"""Reward components in the learner's rollout statistics (learners/rollout_stats.py): reward/<name>."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from learners.rollout_stats import rollout_summary
from tests.learners.learner_fakes import synthetic_group


def _group(rng: np.random.Generator, rewards: list[float], **components: list[float]):
    group = synthetic_group(rng, 3, [2] * len(rewards), rewards=rewards)
    values = {name: np.asarray(v, dtype=np.float32) for name, v in components.items()}
    return dataclasses.replace(group, reward_components=values)


def test_component_means_include_components_that_add_nothing_to_the_reward():
    rng = np.random.default_rng(0)
    # reward = the reward model's score alone (env.reward_fn_weight = 0): `correct` is recorded, not added
    groups = [
        _group(rng, [0.5, -1.0], correct=[1.0, 0.0], reward_model=[0.5, -1.0]),
        _group(rng, [2.0, 0.0], correct=[1.0, 1.0], reward_model=[2.0, 0.0]),
        _group(rng, [0.25, 0.25], reward_model=[0.25, 0.25]),  # the verifier failed on this group: no `correct`
    ]
    summary = rollout_summary(groups, [np.zeros(2, np.int32)] * 3, max_staleness=1)
    assert summary["reward/mean"] == pytest.approx((0.5 - 1.0 + 2.0 + 0.0 + 0.25 + 0.25) / 6)
    assert summary["reward/reward_model"] == pytest.approx(summary["reward/mean"])
    assert summary["reward/correct"] == pytest.approx(3 / 4)  # over the 4 samples that carry it


def test_a_component_named_like_a_statistic_does_not_replace_it():
    rng = np.random.default_rng(1)
    summary = rollout_summary([_group(rng, [1.0, 3.0], mean=[5.0, 7.0])], [np.zeros(2, np.int32)], max_staleness=0)
    assert summary["reward/mean"] == 2.0 and summary["reward/component_mean"] == 6.0


class _TwoRanks:
    """All-reduce (sum / max) between two threads standing for two ranks."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2)
        self.slots: list[np.ndarray | None] = [None, None]

    def reducer(self, rank: int, op):
        def reduce(values: np.ndarray) -> np.ndarray:
            self.slots[rank] = np.asarray(values, dtype=np.float64)
            self.barrier.wait()
            result = op(self.slots[0], self.slots[1])
            self.barrier.wait()  # both read before either writes its next contribution
            return result

        return reduce


def test_ranks_agree_on_the_union_of_their_component_names():
    rng = np.random.default_rng(2)
    shares = [
        [_group(rng, [1.0, 0.0], correct=[1.0, 0.0])],  # rank 0 never saw `reward_model`
        [_group(rng, [0.5, 0.5], correct=[1.0, 1.0], reward_model=[0.5, 0.5])],
    ]
    ranks, summaries = _TwoRanks(), [None, None]

    def rank_main(rank: int) -> None:
        summaries[rank] = rollout_summary(
            shares[rank],
            [np.zeros(2, np.int32)],
            max_staleness=0,
            sum_across_ranks=ranks.reducer(rank, np.add),
            max_across_ranks=ranks.reducer(rank, np.maximum),
            rank=rank,
            world_size=2,
        )

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert summaries[0] == summaries[1]
    assert summaries[0]["reward/correct"] == pytest.approx(3 / 4)
    assert summaries[0]["reward/reward_model"] == pytest.approx(0.5)


def test_completion_length_extremes_over_the_batch_and_across_ranks():
    rng = np.random.default_rng(3)
    one = synthetic_group(rng, 3, [5, 40])
    two = synthetic_group(rng, 3, [12, 300, 7])
    summary = rollout_summary([one, two], [np.zeros(2, np.int32), np.zeros(3, np.int32)], max_staleness=0)
    assert summary["perf/completion_tokens_min"] == 5 and summary["perf/completion_tokens_max"] == 300
    # two ranks, one of which holds no sample: its empty share changes neither extreme
    shares, ranks, summaries = [[two], []], _TwoRanks(), [None, None]

    def rank_main(rank: int) -> None:
        summaries[rank] = rollout_summary(
            shares[rank],
            [np.zeros(3, np.int32)] if shares[rank] else [],
            max_staleness=0,
            sum_across_ranks=ranks.reducer(rank, np.add),
            max_across_ranks=ranks.reducer(rank, np.maximum),
            rank=rank,
            world_size=2,
        )

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert summaries[0] == summaries[1]
    assert summaries[0]["perf/completion_tokens_min"] == 7 and summaries[0]["perf/completion_tokens_max"] == 300
