"""Unit tests for the offline stages' losses (learners.losses: sft_token_nll, bradley_terry_loss, dpo_loss),
against numbers worked by hand. Tolerances: float64 inputs, closed forms evaluated with `math` in float64, so the
only differences are rounding of a few operations (~1e-15); 1e-12 leaves a wide margin."""

from __future__ import annotations

import math

import pytest
import torch

from learners.losses import bradley_terry_loss, dpo_loss, sft_token_nll

TOL = 1e-12  # float64 rounding of a handful of operations (see the module docstring)


def t(*values: float, grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def softplus(x: float) -> float:  # -log sigmoid(-x) = log(1 + e^x)
    return math.log1p(math.exp(x))


def close(actual: torch.Tensor, expected: list[float]) -> None:
    assert actual.shape == (len(expected),)
    for a, e in zip(actual.tolist(), expected, strict=True):
        assert a == pytest.approx(e, abs=TOL)


# ------------------------------------------------------------------------------------------------ SFT


def test_sft_token_nll_sums_minus_logprobs_over_the_mask_only() -> None:
    # row 0: tokens 0 and 1 in the loss: -(-0.5) - (-1.0) = 1.5; token 2 is padding holding NaN (ignored)
    # row 1: token 1 only: 2.25; tokens 0 and 2 hold -inf and 7.0 (ignored); row 2: no loss token -> 0
    logprobs = torch.tensor(
        [[-0.5, -1.0, math.nan], [-math.inf, -2.25, 7.0], [-3.0, -3.0, -3.0]], dtype=torch.float64, requires_grad=True
    )
    mask = torch.tensor([[True, True, False], [False, True, False], [False, False, False]])
    nll = sft_token_nll(logprobs, mask)
    close(nll, [1.5, 2.25, 0.0])
    nll.sum().backward()
    # d nll / d logprob = -1 on loss tokens, 0 elsewhere (no NaN leaks from the ignored positions)
    expected_grad = torch.tensor([[-1.0, -1.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.equal(logprobs.grad, expected_grad)


def test_sft_token_nll_accepts_a_float_mask_and_refuses_a_misshapen_one() -> None:
    close(sft_token_nll(t(-1.0, -2.0).reshape(1, 2), torch.tensor([[1.0, 0.0]])), [1.0])
    with pytest.raises(ValueError, match="mask has shape"):
        sft_token_nll(torch.zeros(2, 3), torch.ones(2, 2, dtype=torch.bool))


# ------------------------------------------------------------------------------------- Bradley-Terry


def test_bradley_terry_loss_and_stats_by_hand() -> None:
    # diff = chosen - rejected = [2 - 1, 0 - 1, 0.5 - 0.5] = [1, -1, 0]
    # loss = -log sigmoid(diff) = log(1 + e^-diff) = [log(1 + e^-1), log(1 + e), log 2] = [0.31326, 1.31326, 0.69315]
    loss, stats = bradley_terry_loss(t(2.0, 0.0, 0.5), t(1.0, 1.0, 0.5))
    close(loss, [softplus(-1.0), softplus(1.0), math.log(2.0)])
    assert loss[0].item() == pytest.approx(0.31326168751822286, abs=TOL)
    close(stats["accuracy"], [1.0, 0.0, 0.0])  # a tie is not a win
    close(stats["margin"], [1.0, -1.0, 0.0])


def test_bradley_terry_margin_shifts_the_difference() -> None:
    # margin 0.5: -log sigmoid(diff - 0.5) for diff = [1, -1]: log(1 + e^-0.5) = 0.47408, log(1 + e^1.5) = 1.70141
    loss, stats = bradley_terry_loss(t(2.0, 0.0), t(1.0, 1.0), margin=0.5)
    close(loss, [softplus(-0.5), softplus(1.5)])
    assert loss.tolist() == pytest.approx([0.47407698418010663, 1.7014132779827524], abs=TOL)
    close(stats["margin"], [1.0, -1.0])  # the stat is the raw difference, margin not subtracted


def test_bradley_terry_gradients_raise_chosen_and_lower_rejected() -> None:
    chosen, rejected = t(2.0, 0.0, grad=True), t(1.0, 1.0, grad=True)
    loss, _ = bradley_terry_loss(chosen, rejected)
    loss.sum().backward()
    # d loss / d r_c = -sigmoid(-diff): diff = 1 -> -sigmoid(-1) = -0.26894; diff = -1 -> -sigmoid(1) = -0.73106
    close(chosen.grad, [-1 / (1 + math.e), -1 / (1 + math.exp(-1.0))])
    close(rejected.grad, [1 / (1 + math.e), 1 / (1 + math.exp(-1.0))])
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()  # a gradient step raises chosen, lowers rejected


def test_bradley_terry_is_stable_for_large_gaps_and_checks_its_inputs() -> None:
    loss, _ = bradley_terry_loss(t(0.0, 1000.0), t(1000.0, 0.0))
    close(loss, [1000.0, 0.0])  # softplus(1000) = 1000 (no overflow to inf), softplus(-1000) = e^-1000 = 0
    with pytest.raises(ValueError, match="one value per pair"):
        bradley_terry_loss(t(1.0, 2.0), t(1.0))
    with pytest.raises(ValueError, match="margin must be >= 0"):
        bradley_terry_loss(t(1.0), t(0.0), margin=-1.0)


# ----------------------------------------------------------------------------------------------- DPO

# Two pairs, beta = 0.5:
#   pair 0: pc = -1, pr = -3, rc = -2, rr = -2.5 -> h = (-1 + 3) - (-2 + 2.5) = 2 - 0.5 = 1.5, beta h = 0.75
#           reward_chosen = 0.5 (-1 + 2) = 0.5, reward_rejected = 0.5 (-3 + 2.5) = -0.25, margin 0.75
#   pair 1: pc = -2, pr = -1, rc = -1, rr = -1   -> h = (-2 + 1) - 0 = -1, beta h = -0.5
#           reward_chosen = 0.5 (-2 + 1) = -0.5, reward_rejected = 0.5 (-1 + 1) = 0, margin -0.5
PC, PR, RC, RR, BETA = (-1.0, -2.0), (-3.0, -1.0), (-2.0, -1.0), (-2.5, -1.0), 0.5


def dpo(kind: str = "sigmoid", label_smoothing: float = 0.0, beta: float = BETA, grad: bool = False):
    pc, pr = t(*PC, grad=grad), t(*PR, grad=grad)
    rc, rr = t(*RC, grad=grad), t(*RR, grad=grad)
    loss, stats = dpo_loss(pc, pr, rc, rr, beta, kind=kind, label_smoothing=label_smoothing)
    return loss, stats, (pc, pr, rc, rr)


def test_dpo_sigmoid_loss_and_stats_by_hand() -> None:
    loss, stats, _ = dpo()
    # -log sigmoid(beta h) = log(1 + e^-(beta h)): log(1 + e^-0.75) = 0.38687, log(1 + e^0.5) = 0.97408
    close(loss, [softplus(-0.75), softplus(0.5)])
    assert loss.tolist() == pytest.approx([0.38687100611489994, 0.9740769841801067], abs=TOL)
    close(stats["reward_chosen"], [0.5, -0.5])
    close(stats["reward_rejected"], [-0.25, 0.0])
    close(stats["accuracy"], [1.0, 0.0])
    close(stats["margin"], [0.75, -0.5])


def test_dpo_sigmoid_is_bradley_terry_on_the_implicit_rewards() -> None:
    loss, stats, _ = dpo()
    bt, _ = bradley_terry_loss(stats["reward_chosen"], stats["reward_rejected"])
    close(loss, bt.tolist())


def test_dpo_label_smoothing_zero_is_plain_sigmoid_and_cdpo_mixes_the_swapped_loss() -> None:
    plain, _, _ = dpo()
    zero, _, _ = dpo(label_smoothing=0.0)
    assert torch.equal(plain, zero)
    smoothed, stats, _ = dpo(label_smoothing=0.1)
    # cDPO, e = 0.1: 0.9 log(1 + e^-(beta h)) + 0.1 log(1 + e^(beta h))
    #   pair 0: 0.9 * 0.38687 + 0.1 * 1.13687 = 0.46187; pair 1: 0.9 * 0.97408 + 0.1 * 0.47408 = 0.92408
    close(smoothed, [0.9 * softplus(-0.75) + 0.1 * softplus(0.75), 0.9 * softplus(0.5) + 0.1 * softplus(-0.5)])
    assert smoothed.tolist() == pytest.approx([0.46187100611489995, 0.9240769841801066], abs=TOL)
    close(stats["margin"], [0.75, -0.5])  # the stats do not depend on the smoothing


def test_dpo_ipo_loss_by_hand_and_its_minimum_at_half_over_beta() -> None:
    loss, stats, _ = dpo(kind="ipo")
    # beta = 0.5: target 1/(2 beta) = 1; (h - 1)^2 = (1.5 - 1)^2 = 0.25 and (-1 - 1)^2 = 4
    close(loss, [0.25, 4.0])
    close(stats["reward_chosen"], [0.5, -0.5])
    # beta = 0.25: target 2. h = 2 + d for pc = -1 + d (pr = rc = rr = -1): loss d^2, gradient 2 d
    for d, expected_loss in ((-0.5, 0.25), (0.0, 0.0), (0.5, 0.25)):
        pc = t(-1.0 + 2.0 + d, grad=True)
        loss, _ = dpo_loss(pc, t(-1.0), t(-1.0), t(-1.0), 0.25, kind="ipo")
        loss.sum().backward()
        close(loss, [expected_loss])
        close(pc.grad, [2 * d])  # zero at h = 1/(2 beta): the minimum; pushes h back toward it from either side


def test_dpo_gradients_favour_chosen_and_leave_the_reference_alone() -> None:
    loss, _, (pc, pr, rc, rr) = dpo(grad=True)
    loss.sum().backward()
    # d loss / d pc = -beta sigmoid(-beta h): pair 0: -0.5 sigmoid(-0.75) = -0.16041; pair 1: -0.5 sigmoid(0.5)
    sig = lambda x: 1 / (1 + math.exp(-x))
    close(pc.grad, [-0.5 * sig(-0.75), -0.5 * sig(0.5)])
    close(pr.grad, [0.5 * sig(-0.75), 0.5 * sig(0.5)])
    assert (pc.grad < 0).all() and (pr.grad > 0).all()  # a step raises the chosen log-prob, lowers the rejected
    assert rc.grad is None and rr.grad is None  # the reference is a constant
    # IPO below its target (pair 1: h = -1 < 1) also raises the chosen log-prob: d/d pc = 2 (h - 1) = -4
    loss, _, (pc, _, _, _) = dpo(kind="ipo", grad=True)
    loss.sum().backward()
    close(pc.grad, [2 * (1.5 - 1.0), 2 * (-1.0 - 1.0)])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beta": 0.0}, "beta must be > 0"),
        ({"kind": "hinge"}, "kind must be one of"),
        ({"label_smoothing": 0.5}, r"label_smoothing must be in \[0, 0.5\)"),
        ({"label_smoothing": 0.1, "kind": "ipo"}, "kind='sigmoid' only"),
    ],
)
def test_dpo_refuses_bad_options(kwargs: dict, message: str) -> None:
    args = {"beta": BETA, "kind": "sigmoid", "label_smoothing": 0.0} | kwargs
    with pytest.raises(ValueError, match=message):
        dpo_loss(
            t(*PC), t(*PR), t(*RC), t(*RR), args["beta"], kind=args["kind"], label_smoothing=args["label_smoothing"]
        )


def test_dpo_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="one value per pair"):
        dpo_loss(t(1.0, 2.0), t(1.0, 2.0), t(1.0), t(1.0, 2.0), BETA)
