"""CISPO and SAPO, `learners.losses.policy_loss(kind="cispo" | "sapo")`: hand-worked values, gradients and
statistics against PPO's on the same tokens, the on-policy point where all three give the policy gradient, their
composition with the importance weight and the mask, and the refusals (function and `[algo]`).

    .venv/bin/python -m pytest tests/learners/test_losses_cispo_sapo.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from common.config import AlgoConfig
from learners.losses import policy_loss
from tests.learners.test_losses_gspo import approx, share, t64

NAN = float("nan")
E = math.exp


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + E(-x))


# Two rows, log pi_theta - log pi_prox = [0.1, 0.5, pad] with A = +1 and [-0.5, 0.0, 0.3] with A = -1; clip 0.2/0.28.
LOG_R = [[0.1, 0.5, 0.0], [-0.5, 0.0, 0.3]]
BAND = {"clip_low": 0.2, "clip_high": 0.28}  # r in [0.8, 1.28]


def example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    prox = t64([[-1.0, -2.0, NAN], [-0.5, -1.5, -1.0]])
    lp = (prox + t64(LOG_R)).nan_to_num(nan=7.0).requires_grad_()
    adv = t64([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = t64([[1, 1, 0], [1, 1, 1]])
    return lp, prox, adv, mask


def loss_grad(**kwargs: object) -> tuple[float, list[list[float]], dict[str, torch.Tensor]]:
    lp, prox, adv, mask = example()
    loss, stats = policy_loss(lp, prox, kwargs.pop("behaviour", None), adv, mask, **kwargs)
    loss.backward()
    return loss.item(), lp.grad.tolist(), stats


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient() -> None:
    loss, grad, stats = loss_grad(kind="cispo", **BAND)
    # r = e^0.1 = 1.1051709 (in band), e^0.5 = 1.6487213 -> 1.28; e^-0.5 = 0.6065307 -> 0.8, 1, e^0.3 = 1.3498588 -> 1.28
    w = [[E(0.1), 1.28], [0.8, 1.0, 1.28]]
    # l = -A w: -1.1051709, -1.28, +0.8, +1, +1.28; token_mean over 5 = 0.6948291 / 5 = 0.1389658
    assert loss == approx((-w[0][0] - w[0][1] + w[1][0] + w[1][1] + w[1][2]) / 5)
    # d l / d lp = -A w / 5 on every action token, the clipped ones included
    assert grad == [approx([-w[0][0] / 5, -1.28 / 5, 0.0]), approx([0.8 / 5, 1.0 / 5, 1.28 / 5])]
    # weights clipped: below the band 1 (r = 0.607), above 2 (1.649, 1.350), whatever the sign of A
    assert stats["clip_frac_low"].item() == share(1 / 5) and stats["clip_frac_high"].item() == share(2 / 5)


def test_ppo_on_the_same_tokens_drops_the_gradient_of_the_ones_it_clips() -> None:
    """The contrast CISPO was made for: PPO's clip zeroes the gradient of row 0's second token (A > 0, r > 1.28) and
    row 1's first (A < 0, r < 0.8); row 1's third (A < 0, r = 1.35 > 1.28) is not clipped on that side."""
    loss, grad, stats = loss_grad(kind="ppo", **BAND)
    # l = -min(r A, clip(r) A): -1.1051709, -1.28, +0.8, +1, +1.3498588
    assert loss == approx((-E(0.1) - 1.28 + 0.8 + 1.0 + E(0.3)) / 5)
    assert grad == [approx([-E(0.1) / 5, 0.0, 0.0]), approx([0.0, 1.0 / 5, E(0.3) / 5])]
    assert stats["clip_frac_low"].item() == share(1 / 5) and stats["clip_frac_high"].item() == share(1 / 5)


def test_sapo_gates_softly_with_a_temperature_per_sign() -> None:
    loss, grad, stats = loss_grad(kind="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    r = [[E(x) for x in row] for row in LOG_R]
    # row 0 (A = +1, tau 1): l = -4 sigmoid(r - 1); row 1 (A = -1, tau 1.05): l = +(4 / 1.05) sigmoid(1.05 (r - 1))
    # = -2.1050, -2.6271 ; +1.7055, +1.9048, +2.0712: token_mean = 0.9494 / 5 = 0.1899
    per_token = [-4 * sigmoid(r[0][0] - 1), -4 * sigmoid(r[0][1] - 1)]
    per_token += [4 / 1.05 * sigmoid(1.05 * (x - 1)) for x in r[1]]
    assert loss == approx(sum(per_token) / 5)
    # d l / d lp = -A g r / 5, g = 4 s (1 - s), s = sigmoid(tau (r - 1)): g = 1 at r = 1 (row 1, token 2)
    gate = [[4 * sigmoid(r[0][t] - 1) * (1 - sigmoid(r[0][t] - 1)) for t in (0, 1)]]
    gate += [[4 * sigmoid(1.05 * (x - 1)) * (1 - sigmoid(1.05 * (x - 1))) for x in r[1]]]
    assert gate[1][1] == 1.0 and gate[0][1] < gate[0][0] < 1.0  # 0.9078 < 0.9972: further from r = 1, less gradient
    expected = [[-gate[0][t] * r[0][t] / 5 for t in (0, 1)] + [0.0], [gate[1][t] * r[1][t] / 5 for t in range(3)]]
    assert grad == [approx(expected[0]), approx(expected[1])]
    assert stats["sapo_gate_mean"].item() == approx((sum(gate[0]) + sum(gate[1])) / 5)
    assert stats["clip_frac"].item() == 0.0  # no hard band


def test_on_policy_all_three_give_the_policy_gradient() -> None:
    """At r = 1 (the first step of every batch) PPO's, CISPO's and SAPO's gradient is the policy gradient -A d log pi;
    the value is -A for PPO and CISPO, and -A (4 / tau) sigmoid(0) = -2 A / tau for SAPO (its gate's own scale)."""
    lp = t64([[-1.0, -2.0], [-0.5, -1.5]]).requires_grad_()
    adv, mask = t64([[2.0, 2.0], [-1.0, -1.0]]), t64([[1, 1], [1, 1]])
    results = []
    for kind in ("ppo", "cispo", "sapo"):
        x = lp.detach().clone().requires_grad_()
        loss, _ = policy_loss(x, lp.detach(), None, adv, mask, kind=kind, sapo_tau_neg=3.0)
        loss.backward()
        results.append((loss.item(), x.grad.tolist()))
    assert results[0][0] == results[1][0] == approx((-2 - 2 + 1 + 1) / 4)
    assert results[2][0] == approx((-2 * 2 * 2 + 2 / 3.0 * 2) / 4)  # A = 2 at tau 1, A = -1 at tau 3
    for _, grad in results:
        assert grad == [approx([-0.5, -0.5]), approx([0.25, 0.25])]


def test_the_importance_weight_and_the_mask_apply_as_with_ppo() -> None:
    """w = min(pi_prox / pi_behaviour, tis_cap) multiplies CISPO's and SAPO's per-token loss; is_mask drops a token
    from the loss and the denominator."""
    _, prox, _, _ = example()
    behaviour = prox - t64([[math.log(1.5), 0.0, 0.0], [0.0, 0.0, math.log(3.0)]])  # rho = 1.5 and 3 -> cap 2
    plain, _, _ = loss_grad(kind="cispo", **BAND)
    weighted, grad, stats = loss_grad(kind="cispo", behaviour=behaviour, correction="tis", tis_cap=2.0, **BAND)
    # tokens 0 and 4 weighted 1.5 and 2: + 0.5 (-1.1051709) + 1 (1.28), over 5
    assert weighted == approx(plain + (0.5 * -E(0.1) + 1.0 * 1.28) / 5)
    assert grad[0][0] == approx(-1.5 * E(0.1) / 5) and grad[1][2] == approx(2.0 * 1.28 / 5)
    masked, grad, stats = loss_grad(kind="sapo", behaviour=behaviour, is_mask="token", is_mask_high=2.5)
    r = [[E(x) for x in row] for row in LOG_R]  # row 1's third token (rho = 3) is rejected: 4 tokens remain
    per_token = [-4 * sigmoid(r[0][0] - 1), -4 * sigmoid(r[0][1] - 1)]
    per_token += [4 / 1.05 * sigmoid(1.05 * (x - 1)) for x in r[1][:2]]
    assert masked == approx(sum(per_token) / 4) and grad[1][2] == 0.0
    assert stats["is_masked_frac"].item() == share(1 / 5)


def test_cispo_with_no_lower_bound() -> None:
    """clip_low = 1: the band is [0, 1 + clip_high], MiniMax-M1's setting; row 1's first weight stays 0.6065307."""
    _, grad, stats = loss_grad(kind="cispo", clip_low=1.0, clip_high=0.28)
    assert grad[1][0] == approx(E(-0.5) / 5) and stats["clip_frac_low"].item() == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "grpo"}, "kind must be one of"),
        ({"kind": "cispo", "dual_clip": 3.0}, "token-level loss"),
        ({"kind": "sapo", "ratio": "sequence", "aggregation": "seq_mean"}, "token-level loss"),
        ({"kind": "sapo", "sapo_tau_neg": 0.0}, "must be > 0"),
        ({"clip_low": 1.5}, "0 <= clip_low <= 1"),
    ],
)
def test_refusals_name_the_argument(kwargs: dict, message: str) -> None:
    lp, prox, adv, mask = example()
    with pytest.raises(ValueError, match=message):
        policy_loss(lp, prox, None, adv, mask, **kwargs)


def test_algo_config_takes_the_losses_and_refuses_what_they_cannot_do() -> None:
    assert AlgoConfig(policy_loss="cispo", clip_low=1.0, clip_high=4.0).clip_low == 1.0
    assert AlgoConfig(policy_loss="sapo").sapo_tau_neg == 1.05  # TRL's and the paper's defaults
    with pytest.raises(ValidationError, match="algo.ratio = 'token'"):
        AlgoConfig(policy_loss="sapo", dual_clip=3.0)
    with pytest.raises(ValidationError, match="algo.ratio = 'token'"):
        AlgoConfig(policy_loss="cispo", ratio="sequence", aggregation="seq_mean", correction="none")
