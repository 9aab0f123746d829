"""Overlong completions (`learners.overlong`): DAPO's soft penalty, the truncated rows, and the masked loss, by hand.

.venv/bin/python -m pytest tests/learners/test_overlong.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import AlgoConfig
from common.types import RolloutGroup
from learners.estimators import batch_advantages
from learners.losses import policy_loss
from learners.overlong import mask_rows, model_tokens, overlong_penalty, truncated_rows


def approx(x: object) -> object:
    return pytest.approx(x, rel=1e-6, abs=1e-7)  # float32 results of a few operations on small numbers


def test_penalty_hand() -> None:
    # L_max = 10, L_cache = 4: no penalty up to 10 - 4 = 6 tokens, then (6 - |y|) / 4, -1 beyond 10
    lengths = torch.tensor([0, 6, 7, 9, 10, 11])
    # 0, 6 -> 0;  7 -> (6 - 7) / 4 = -0.25;  9 -> -3/4;  10 (cut at the limit) -> -4/4 = -1;  11 -> -1
    assert overlong_penalty(lengths, budget=10, window=4).tolist() == approx([0, 0, -0.25, -0.75, -1, -1])
    assert overlong_penalty(lengths, 10, 4, scale=0.5).tolist() == approx([0, 0, -0.125, -0.375, -0.5, -0.5])
    # the window as wide as the budget: the ramp starts at 0 tokens, 5 -> (0 - 5) / 10 = -0.5
    assert overlong_penalty(torch.tensor([0, 5, 10]), 10, 10).tolist() == approx([0, -0.5, -1])
    assert overlong_penalty(lengths, 10, 4).dtype == torch.float32


@pytest.mark.parametrize(("budget", "window", "scale"), [(10, 0, 1.0), (10, 11, 1.0), (10, 4, -1.0)])
def test_penalty_refuses_bad_arguments(budget: int, window: int, scale: float) -> None:
    with pytest.raises(ValueError, match="window|scale"):
        overlong_penalty(torch.tensor([3]), budget, window, scale)


def group(reasons: list[str], loss_masks: list[list[int]]) -> RolloutGroup:
    n = len(reasons)
    lengths = [len(m) for m in loss_masks]
    return RolloutGroup(
        lease_id=1,
        prompt_id=0,
        epoch=0,
        generator_id=0,
        prompt_tokens=np.array([1, 2], dtype=np.int32),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        completion_tokens=np.ones(sum(lengths), dtype=np.int32),
        behaviour_logprobs=np.zeros(sum(lengths), dtype=np.float32),
        loss_mask=np.concatenate([np.array(m, dtype=np.uint8) for m in loss_masks]),
        token_versions=np.zeros(sum(lengths), dtype=np.int32),
        versions=np.zeros(n, dtype=np.int32),
        rewards=np.zeros(n, dtype=np.float32),
        finish_reasons=reasons,
    )


def test_truncated_rows_follow_the_batch_order_and_model_tokens_skip_env_tokens() -> None:
    groups = [group(["stop", "length"], [[1, 1], [1, 1, 1]]), group(["length", "done"], [[1, 0, 0, 1], [1]])]
    assert truncated_rows(groups).tolist() == [False, True, True, False]
    # multi-turn row: 1 model token, 2 environment tokens, 1 model token -> |y| = 2
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert model_tokens(mask).tolist() == [2, 3, 2, 1]


def test_masked_loss_hand() -> None:
    # three rows, r = 1 everywhere (lp = prox), advantages 1, 5, -2; row 1 is truncated and leaves the loss
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    kept = mask_rows(mask, torch.tensor([False, True, False]))
    assert kept.tolist() == [[True, True, True], [False, False, False], [True, False, False]]
    adv = torch.tensor([[1.0] * 3, [5.0] * 3, [-2.0] * 3], dtype=torch.float64)
    for aggregation, expected in (
        # token_mean: (3 x -1 + 1 x 2) / 4 kept tokens = -0.25   (all rows: (-3 - 10 + 2) / 6 = -1.8333)
        ("token_mean", -0.25),
        # seq_mean: rows -1 and +2 over the 2 kept rows = 0.5     (all rows: (-1 - 5 + 2) / 3 = -1.3333)
        ("seq_mean", 0.5),
    ):
        lp = torch.zeros(3, 3, dtype=torch.float64, requires_grad=True)
        loss, _ = policy_loss(lp, lp.detach(), None, adv, kept, aggregation=aggregation)
        assert loss.item() == approx(expected)
        loss.backward()
        assert lp.grad[1].tolist() == [0.0, 0.0, 0.0]  # the truncated row: no gradient at all
    # every row truncated: loss 0, no NaN
    lp = torch.zeros(3, 3, dtype=torch.float64, requires_grad=True)
    assert policy_loss(lp, lp.detach(), None, adv, mask_rows(mask, torch.ones(3, dtype=torch.bool)))[0].item() == 0


def test_penalty_enters_the_rewards_of_every_estimator() -> None:
    # one group, both answers right (reward 1); lengths 5 and 10 of L_max = 10, L_cache = 4 -> penalties 0 and -1
    mask = torch.tensor([[True] * 5 + [False] * 5, [True] * 10])
    rewards = torch.tensor([1.0, 1.0]) + overlong_penalty(model_tokens(mask), 10, 4)  # [1, 0]
    ids = torch.tensor([0, 0])
    # grpo: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.7071068 -> A = +-0.5 / 0.7071068 = +-0.7071068
    adv, _ = batch_advantages(AlgoConfig(), rewards, ids, mask)
    assert adv[:, 0].tolist() == approx([0.7071061, -0.7071061])  # eps = 1e-6 in the std: 0.5 / 0.7071078
    # rloo: A = r_i - r_other = +-1; without the penalty both are 0 (an equal-reward group teaches nothing)
    adv, _ = batch_advantages(AlgoConfig(estimator="rloo"), rewards, ids, mask)
    assert adv[:, 0].tolist() == approx([1.0, -1.0])
