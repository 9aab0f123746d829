"""Rejection (masking) on rho = pi_prox / pi_behaviour in `learners.losses.policy_loss(is_mask=...)` and
`learners.losses.importance_mask`: hand-worked kept tokens and losses for the three kinds, the denominator rule
(rejected tokens leave the count), composition with TIS truncation and with GSPO, the identity when nothing is
outside the band, garbage in padding, zero gradients on rejected tokens, the refusals, and the metrics that
`learners.objective.policy_objective` records. CPU only, about a second:

    .venv/bin/python -m pytest tests/learners/test_losses_is_mask.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from common.config import AlgoConfig
from learners.batching import ModelInputs
from learners.losses import importance_mask, policy_loss
from learners.objective import policy_objective
from learners.update_stats import GlobalAverages

L = math.log
NAN, INF = float("nan"), float("inf")


def t64(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def approx(x: object) -> object:
    return pytest.approx(x, rel=1e-12, abs=1e-12)  # float64 sums of a few terms


def batch() -> dict[str, torch.Tensor]:
    """The 2x3 batch every hand-worked test uses. pi_theta = pi_prox (r = 1: no clip), so l_t = -w_t A_t.
    rho = pi_prox / pi_behaviour:  row 0 [1.5, 1.5, 1.5]  (product 3.375, geometric mean 1.5)
                                   row 1 [4.0, 1.5, pad]  (product 6,     geometric mean sqrt 6 = 2.449)
    Row 1's last position is padding and holds NaN / inf in every input."""
    prox = t64([[0.0, 0.0, 0.0], [0.0, 0.0, NAN]])
    return {
        "lp": prox.clone(),
        "prox": prox,
        "behaviour": t64([[-L(1.5), -L(1.5), -L(1.5)], [-L(4.0), -L(1.5), INF]]),
        "adv": t64([[1.0, 2.0, 4.0], [8.0, 16.0, INF]]),
        "mask": t64([[1, 1, 1], [1, 1, 0]]),
    }


def loss_of(b: dict[str, torch.Tensor], **kw: object) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    lp = b["lp"].clone().requires_grad_()
    loss, stats = policy_loss(lp, b["prox"], b["behaviour"], b["adv"], b["mask"], **kw)
    loss.backward()
    return loss, stats, lp.grad


def test_importance_mask_hand() -> None:
    b = batch()
    m = b["mask"].bool()
    # token, band [0.5, 2]: 4.0 is out, every 1.5 is in; padding is never kept
    token = importance_mask(b["prox"], b["behaviour"], m, "token", 0.5, 2.0)
    assert token.tolist() == [[True, True, True], [False, True, False]]
    # sequence: 3.375 > 2 and 6 > 2, both rows out; with high = 4: 3.375 in, 6 out
    assert not importance_mask(b["prox"], b["behaviour"], m, "sequence", 0.5, 2.0).any()
    seq4 = importance_mask(b["prox"], b["behaviour"], m, "sequence", 0.5, 4.0)
    assert seq4.tolist() == [[True, True, True], [False, False, False]]
    # geometric: 1.5 in, 2.449 out (a subset of sequence's rejections: |mean log rho| <= |sum log rho|)
    geo = importance_mask(b["prox"], b["behaviour"], m, "geometric", 0.5, 2.0)
    assert geo.tolist() == [[True, True, True], [False, False, False]]
    # the bounds are inclusive: rho = 4.0 exactly is kept at high = 4 (log 4 == log 4, no rounding in between)
    assert importance_mask(b["prox"], b["behaviour"], m, "token", 0.25, 4.0).tolist() == [
        [True] * 3,
        [True, True, False],
    ]
    # the lower bound: rho = 1/3 on one token is out of [0.5, 2], in [0.25, 4]
    lower = torch.where(m, t64([[L(3.0), 0.0, 0.0], [0.0, 0.0, 0.0]]), b["behaviour"])
    assert importance_mask(b["prox"], lower, m, "token", 0.5, 2.0)[0].tolist() == [False, True, True]
    assert importance_mask(b["prox"], lower, m, "token", 0.25, 4.0)[0].tolist() == [True, True, True]


def test_token_mask_hand_and_denominator() -> None:
    b = batch()
    # kept [[1, 1, 1], [0, 1, 0]]: l = -1, -2, -4, -16 over 4 kept tokens = -23/4 = -5.75
    # (dividing by all 5 action tokens, as OpenRLHF's icepop and TRL's token_mask do, would give -23/5 = -4.6)
    loss, stats, grad = loss_of(b, is_mask="token")
    assert loss.item() == approx(-23 / 4) and loss.item() != approx(-23 / 5)
    assert stats["is_masked_frac"].item() == pytest.approx(1 / 5) and stats["is_masked_seq_frac"].item() == 0.5
    # d l_t / d log pi_theta = -A_t r_t = -A_t, over 4 kept tokens; the rejected token and the padding get 0
    assert grad.tolist() == [[-1 / 4, -2 / 4, -4 / 4], [0.0, -16 / 4, 0.0]]
    # seq_mean: row 0 (-1 - 2 - 4) / 3 = -7/3, row 1 -16 (its one kept token) -> (-7/3 - 16) / 2 = -55/6
    assert loss_of(b, is_mask="token", aggregation="seq_mean")[0].item() == approx(-55 / 6)
    # unmasked, for contrast: (-1 - 2 - 4 - 8 - 16) / 5 = -6.2
    assert loss_of(b)[0].item() == approx(-31 / 5)


def test_sequence_and_geometric_masks_hand() -> None:
    b = batch()
    # sequence, [0.5, 2]: both products out -> nothing left: loss 0, no gradient, every token and row masked
    loss, stats, grad = loss_of(b, is_mask="sequence")
    assert loss.item() == 0.0 and grad.abs().sum() == 0
    assert stats["is_masked_frac"].item() == 1.0 and stats["is_masked_seq_frac"].item() == 1.0
    # sequence, [0.5, 4]: row 0 (3.375) kept, row 1 (6) rejected -> (-1 - 2 - 4) / 3 = -7/3
    loss, stats, grad = loss_of(b, is_mask="sequence", is_mask_high=4.0)
    assert loss.item() == approx(-7 / 3) and grad[1].abs().sum() == 0
    assert stats["is_masked_frac"].item() == pytest.approx(2 / 5) and stats["is_masked_seq_frac"].item() == 0.5
    # geometric, [0.5, 2]: row 0 (1.5) kept, row 1 (2.449) rejected -> -7/3, both aggregations
    for aggregation in ("token_mean", "seq_mean"):
        loss, stats, grad = loss_of(b, is_mask="geometric", aggregation=aggregation)
        assert loss.item() == approx(-7 / 3)
        assert grad.tolist() == [[-1 / 3, -2 / 3, -4 / 3], [0.0, 0.0, 0.0]]
        assert stats["is_masked_seq_frac"].item() == 0.5


def test_masks_compose_with_tis_truncation() -> None:
    b = batch()
    # token mask + token TIS, cap 2: kept w = 1.5 everywhere (the 4.0 that would be truncated to 2 is rejected)
    # l = -1.5 (1 + 2 + 4 + 16) = -34.5 over 4 = -8.625; nothing truncated among the kept
    loss, stats, _ = loss_of(b, is_mask="token", correction="tis", tis_cap=2.0)
    assert loss.item() == approx(-8.625) and stats["is_truncated_frac"].item() == 0.0
    assert stats["is_weight_mean"].item() == approx(1.5) and stats["is_weight_max"].item() == approx(1.5)
    # without the mask: w = [1.5, 1.5, 1.5], [2, 1.5] -> -(1.5 + 3 + 6 + 16 + 24) / 5 = -10.1, 1 of 5 truncated
    loss, stats, _ = loss_of(b, correction="tis", tis_cap=2.0)
    assert loss.item() == approx(-10.1) and stats["is_truncated_frac"].item() == pytest.approx(1 / 5)
    # cap 1.2 truncates every kept weight: -1.2 * 23 / 4 = -6.9, all 4 kept tokens truncated
    loss, stats, _ = loss_of(b, is_mask="token", correction="decoupled", tis_cap=1.2)
    assert loss.item() == approx(-6.9) and stats["is_truncated_frac"].item() == 1.0
    # token mask + sequence TIS (cap 4): the product is over the KEPT tokens, as if the rejected were not sampled
    # row 0: w = 3.375 -> -3.375 * 7 = -23.625; row 1: w = 1.5 (not 4 * 1.5 = 6 -> 4) -> -24; / 4 = -11.90625
    loss, _, _ = loss_of(b, is_mask="token", correction="tis", tis_level="sequence", tis_cap=4.0)
    assert loss.item() == approx(-47.625 / 4)
    # geometric mask + sequence TIS (cap 4): row 0 kept with w = 3.375 -> -23.625 / 3 = -7.875
    loss, _, _ = loss_of(b, is_mask="geometric", correction="tis", tis_level="sequence", tis_cap=4.0)
    assert loss.item() == approx(-7.875)


def test_masks_compose_with_gspo() -> None:
    b = batch()
    gspo = {"ratio": "sequence", "aggregation": "seq_mean"}
    # s_i = 1 (pi_theta = pi_prox): row 0's loss -7/3 is all that is left after the geometric mask
    loss, stats, grad = loss_of(b, is_mask="geometric", **gspo)
    assert loss.item() == approx(-7 / 3) and grad[1].abs().sum() == 0 and stats["seq_clip_frac"].item() == 0.0
    loss, _, _ = loss_of(b, is_mask="geometric", correction="tis", tis_level="sequence", tis_cap=4.0, **gspo)
    assert loss.item() == approx(-7.875)
    with pytest.raises(ValueError, match="is_mask='token' would drop tokens"):
        loss_of(b, is_mask="token", **gspo)


@pytest.mark.parametrize("kind", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_no_token_outside_the_band_is_the_unmasked_loss_exactly(kind: str, aggregation: str) -> None:
    gen = torch.Generator().manual_seed(7)
    mask = (torch.rand(5, 8, generator=gen) < 0.7).double()
    mask[0] = 0  # an empty row
    behaviour = -torch.rand(5, 8, generator=gen, dtype=torch.float64) * 3
    prox = behaviour + 0.1 * torch.randn(5, 8, generator=gen, dtype=torch.float64)  # |log rho| << log 1e3 / 8
    current = prox + 0.4 * torch.randn(5, 8, generator=gen, dtype=torch.float64)  # some tokens clip
    adv = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    garbage = ~mask.bool()
    kw = {"correction": "tis", "tis_cap": 1.05, "dual_clip": 2.0, "aggregation": aggregation}
    results = []
    for is_mask in ("none", kind):
        lp = torch.where(garbage, NAN, current).requires_grad_()
        loss, stats = policy_loss(
            lp,
            torch.where(garbage, INF, prox),
            torch.where(garbage, NAN, behaviour),
            torch.where(garbage, INF, adv),
            mask,
            is_mask=is_mask,
            is_mask_low=1e-3,
            is_mask_high=1e3,
            **kw,
        )
        loss.backward()
        results.append((loss, stats, lp.grad))
    (plain, plain_stats, plain_grad), (masked, masked_stats, masked_grad) = results
    assert masked.item() == plain.item() and torch.equal(masked_grad, plain_grad)
    assert torch.isfinite(masked_grad).all() and masked_grad[garbage].abs().sum() == 0
    assert masked_stats["is_masked_frac"].item() == 0.0 and masked_stats["is_masked_seq_frac"].item() == 0.0
    assert all(torch.equal(plain_stats[k], masked_stats[k]) for k in plain_stats)


def test_rejected_tokens_get_no_gradient_with_clipping_and_garbage() -> None:
    gen = torch.Generator().manual_seed(3)
    mask = torch.ones(4, 6)
    mask[:, 4:] = 0
    behaviour = -torch.rand(4, 6, generator=gen, dtype=torch.float64)
    prox = behaviour + 1.0 * torch.randn(4, 6, generator=gen, dtype=torch.float64)  # many tokens out of the band
    lp = (prox + 0.5 * torch.randn(4, 6, generator=gen, dtype=torch.float64)).masked_fill(~mask.bool(), NAN)
    lp.requires_grad_()
    adv = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    loss, stats = policy_loss(lp, prox, behaviour, adv, mask, correction="tis", is_mask="token")
    loss.backward()
    kept = importance_mask(prox, behaviour, mask.bool(), "token", 0.5, 2.0)
    assert 0 < stats["is_masked_frac"].item() < 1 and torch.isfinite(loss)
    assert lp.grad[~kept].abs().sum() == 0 and lp.grad[kept].abs().sum() > 0
    assert stats["is_masked_frac"].item() == pytest.approx(1 - kept.sum().item() / 16)


def test_is_mask_argument_errors() -> None:
    x, mask = torch.zeros(1, 2), torch.ones(1, 2)
    for kw, match in (
        ({"is_mask": "tokens"}, "is_mask must be one of"),
        ({"is_mask": "token", "is_mask_low": 1.0}, "0 < is_mask_low < 1 < is_mask_high"),
        ({"is_mask": "token", "is_mask_low": 0.0}, "0 < is_mask_low < 1 < is_mask_high"),
        ({"is_mask": "token", "is_mask_high": 1.0}, "0 < is_mask_low < 1 < is_mask_high"),
        ({"is_mask": "sequence", "is_mask_low": 0.9, "is_mask_high": 0.95}, "0 < is_mask_low < 1 < is_mask_high"),
    ):
        with pytest.raises(ValueError, match=match):
            policy_loss(x, x, x, x, mask, **kw)
    with pytest.raises(ValueError, match="is_mask='geometric' needs behaviour_logprobs"):
        policy_loss(x, x, None, x, mask, is_mask="geometric")
    with pytest.raises(ValueError, match="kind must be one of"):
        importance_mask(x, x, mask.bool(), "none", 0.5, 2.0)


def test_policy_objective_records_the_masked_shares() -> None:
    b = batch()
    mask = b["mask"].bool()
    inputs = ModelInputs(
        input_ids=torch.zeros(2, 3, dtype=torch.long),
        attention_mask=None,
        position_ids=torch.zeros(2, 3, dtype=torch.long),
        completion_tokens=torch.zeros(2, 3, dtype=torch.long),
        loss_mask=mask,
        behaviour_logprobs=b["behaviour"],
    )
    stats = GlobalAverages()
    algo = AlgoConfig(correction="none", is_mask="token")
    lp = b["lp"].clone().requires_grad_()
    loss = policy_objective(algo, inputs, lp, torch.zeros(2, 3), b["prox"], None, b["adv"], stats, 1.0, 1.0)
    assert loss.item() == approx(-23 / 4)  # as in test_token_mask_hand_and_denominator
    assert stats.sums["policy/is_masked_frac"] == pytest.approx(1 / 5)
    assert stats.sums["policy/is_masked_seq_frac"] == 0.5
    stats = GlobalAverages()
    policy_objective(AlgoConfig(), inputs, lp, torch.zeros(2, 3), b["prox"], None, b["adv"], stats, 0.5, 0.5)
    assert stats.sums["policy/is_masked_frac"] == 0.0 and stats.sums["policy/is_masked_seq_frac"] == 0.0
