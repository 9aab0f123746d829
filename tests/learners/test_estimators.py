"""Advantages for each estimator over a batch split across ranks equal those over the whole batch (two ranks
simulated by two threads whose sums meet at a barrier), and agree with the single-batch math."""

from __future__ import annotations

import threading

import pytest
import torch

from common.config import AlgoConfig
from learners.advantages import masked_whiten, reinforce_pp_advantages
from learners.estimators import batch_advantages, terminal_rewards, whiten_across_ranks


class TwoRanks:
    """`sum_ranks` for two threads: each contributes its tensor; both get the sum (like an all-reduce)."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=10)
        self.slots: list[torch.Tensor | None] = [None, None]

    def sum_for(self, rank: int):
        def sum_ranks(tensor: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            total = self.slots[0] + self.slots[1]
            self.barrier.wait()
            return total

        return sum_ranks


def batch(seed: int, size: int = 8, width: int = 6) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (size,), generator=gen)
    mask = torch.arange(width)[None] < lengths[:, None]
    mask[1, 0] = False  # an environment token
    return {
        "rewards": torch.randint(0, 2, (size,), generator=gen).float() + 0.1 * torch.rand(size, generator=gen),
        "group_ids": torch.arange(size) // 4,
        "mask": mask,
        "old_values": torch.randn(size, width, generator=gen),
        "kl": torch.rand(size, width, generator=gen) * mask,
    }


def advantages(algo: AlgoConfig, data: dict[str, torch.Tensor], rows: slice, use_kl: bool, sum_ranks=None):
    kwargs = {"sum_ranks": sum_ranks} if sum_ranks is not None else {}
    return batch_advantages(
        algo,
        data["rewards"][rows],
        data["group_ids"][rows],
        data["mask"][rows],
        old_values=data["old_values"][rows],
        kl=data["kl"][rows] if use_kl else None,
        **kwargs,
    )


@pytest.mark.parametrize(
    "estimator, use_kl",
    [
        ("grpo", False),
        ("dr_grpo", False),
        ("rloo", False),
        ("reinforce_pp", False),
        ("reinforce_pp", True),
        ("reinforce_pp_baseline", False),
        ("gae", False),
        ("gae", True),
    ],
)
def test_two_ranks_get_the_advantages_of_the_whole_batch(estimator: str, use_kl: bool) -> None:
    algo = AlgoConfig(estimator=estimator, group_size=4, kl_coef=0.3, lam=0.9)
    data = batch(seed=len(estimator) + use_kl)
    whole, whole_returns = advantages(algo, data, slice(0, 8), use_kl)
    ranks, results = TwoRanks(), [None, None]

    def run(rank: int) -> None:
        results[rank] = advantages(algo, data, slice(4 * rank, 4 * rank + 4), use_kl, ranks.sum_for(rank))

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    split = torch.cat([results[0][0], results[1][0]])
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6)
    assert (whole[~data["mask"]] == 0).all() and whole.abs().sum() > 0
    if estimator == "gae":
        torch.testing.assert_close(torch.cat([results[0][1], results[1][1]]), whole_returns)
    else:
        assert whole_returns is None


def test_one_rank_matches_the_batch_math_of_learners_advantages() -> None:
    data = batch(seed=3)
    mask = data["mask"]
    torch.testing.assert_close(
        whiten_across_ranks(data["old_values"], mask), masked_whiten(data["old_values"], mask), rtol=1e-5, atol=1e-6
    )
    adv, _ = advantages(AlgoConfig(estimator="reinforce_pp", group_size=4), data, slice(0, 8), use_kl=False)
    expected = reinforce_pp_advantages(data["rewards"])  # (r - mean) / (std + 1e-6) vs * rsqrt(var + 1e-8)
    torch.testing.assert_close(adv[:, 0][mask[:, 0]], expected[mask[:, 0]], rtol=1e-4, atol=1e-5)


def test_terminal_rewards_sit_on_the_last_action_token() -> None:
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    rewards = torch.tensor([2.0, 5.0, -1.0])
    assert terminal_rewards(rewards, mask).tolist() == [[0, 0, 0, 2.0, 0], [0] * 5, [-1.0, 0, 0, 0, 0]]


def test_kl_in_the_reward_of_a_group_estimator_and_gae_without_values_are_refused() -> None:
    data = batch(seed=0)
    with pytest.raises(ValueError, match="algo.kl_in_reward: only with estimator"):
        advantages(AlgoConfig(estimator="rloo", group_size=4), data, slice(0, 8), use_kl=True)
    with pytest.raises(ValueError, match="needs the critic's values"):
        batch_advantages(AlgoConfig(estimator="gae", group_size=4), data["rewards"], data["group_ids"], data["mask"])
