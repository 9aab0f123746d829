"""Advantages for each estimator over a batch split across ranks equal those over the whole batch (two ranks
simulated by two threads whose sums meet at a barrier), agree with a python reference of the batch math, and
REINFORCE++'s advantages are continuous in algo.kl_coef."""

from __future__ import annotations

import statistics
import threading

import pytest
import torch

from common.config import AlgoConfig
from learners.estimators import batch_advantages, terminal_rewards


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
    # Whitening's mean and variance are float32 sums over the batch's <= 48 action tokens, added in another order
    # when each rank sums its half: <= 48 eps_f32 relative in the worst case, so ~6e-6 of |(x - mu) / sigma| ~ 1;
    # rtol 1e-5 (84 eps_f32) and atol 1e-6 for entries near 0. A rank whitening with its own statistics instead of
    # the global ones is off by 0.24 to 1.1 here.
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6)
    assert (whole[~data["mask"]] == 0).all() and whole.abs().sum() > 0
    if estimator == "gae":
        torch.testing.assert_close(torch.cat([results[0][1], results[1][1]]), whole_returns)
    else:
        assert whole_returns is None


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline"])
def test_one_rank_matches_a_python_reference_weighing_each_action_token_once(estimator: str) -> None:
    data = batch(seed=3)
    mask, rewards = data["mask"], data["rewards"].tolist()
    groups = data["group_ids"].tolist()
    if estimator == "reinforce_pp_baseline":  # subtract the mean of the sample's group first
        means = {g: statistics.fmean(r for r, h in zip(rewards, groups) if h == g) for g in set(groups)}
        rewards = [r - means[g] for r, g in zip(rewards, groups)]
    tokens = [r for r, row in zip(rewards, mask) for _ in range(int(row.sum()))]  # one entry per action token
    mu, var = statistics.fmean(tokens), statistics.pvariance(tokens)
    expected = torch.where(mask, (torch.tensor(rewards)[:, None] - mu) / (var + 1e-8) ** 0.5, 0)
    adv, _ = advantages(AlgoConfig(estimator=estimator, group_size=4), data, slice(0, 8), use_kl=False)
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)  # float32 rewards and output: ~100 ulps


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_is_continuous_in_kl_coef(estimator: str) -> None:
    """The KL in the reward does not change how the batch is weighed: kl_coef -> 0 gives the advantages of no KL."""
    data = batch(seed=5)
    without, _ = advantages(AlgoConfig(estimator=estimator, group_size=4), data, slice(0, 8), use_kl=False)
    for kl_coef, tolerance in ((0.0, 0.0), (1e-9, 1e-6), (1e-3, 1e-2)):
        algo = AlgoConfig(estimator=estimator, group_size=4, kl_coef=kl_coef, kl_in_reward=True)
        with_kl, _ = advantages(algo, data, slice(0, 8), use_kl=True)
        # kl in [0, 1) on <= 6 tokens: the returns move by < 6 * kl_coef, the whitened advantages by about that
        # over the std of the rewards (~0.5): 1e-9 -> < 2e-8 (1e-6 is float32 rounding), 1e-3 -> < 1.2e-2
        torch.testing.assert_close(with_kl, without, rtol=0, atol=tolerance)
    far, _ = advantages(AlgoConfig(estimator=estimator, group_size=4, kl_coef=0.3), data, slice(0, 8), use_kl=True)
    assert (far - without).abs().max() > 0.05  # and the KL does act when its coefficient is not tiny


def test_terminal_rewards_sit_on_the_last_action_token() -> None:
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    rewards = torch.tensor([2.0, 5.0, -1.0])
    assert terminal_rewards(rewards, mask).tolist() == [[0, 0, 0, 2.0, 0], [0] * 5, [-1.0, 0, 0, 0, 0]]


def test_a_kl_passed_to_a_group_estimator_and_gae_without_values_are_refused() -> None:
    data = batch(seed=0)
    with pytest.raises(ValueError, match="kl: estimator 'rloo' has no per-token reward"):
        advantages(AlgoConfig(estimator="rloo", group_size=4), data, slice(0, 8), use_kl=True)
    with pytest.raises(ValueError, match="needs the critic's values"):
        batch_advantages(AlgoConfig(estimator="gae", group_size=4), data["rewards"], data["group_ids"], data["mask"])
