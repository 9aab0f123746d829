"""GSPO's sequence-level ratio in `learners.losses.policy_loss(ratio="sequence")`: hand-worked value and gradient,
an autograd reference of the paper's sequence objective, its equality with the token-level loss when every token of
a row has the same log-ratio, its composition with sequence-level TIS and the dual clip, and the refusals.

    .venv/bin/python -m pytest tests/learners/test_losses_gspo.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from learners.losses import policy_loss, sequence_log_ratio

NAN = float("nan")
GSPO = {"ratio": "sequence", "aggregation": "seq_mean"}


def t64(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def approx(x: object) -> object:
    return pytest.approx(x, rel=1e-9, abs=1e-12)  # float64 throughout: a few ulps of sums of 3 terms


def share(x: float) -> object:
    return pytest.approx(x, rel=1e-7)  # counts over counts come out in float32: one rounding, 2^-24 = 6e-8


def example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows: log pi_theta - log pi_prox = [0.1, 0.3, pad] (A = +1) and [-0.2, -0.4, -0.3] (A = -1)."""
    prox = t64([[-1.0, -2.0, NAN], [-0.5, -1.5, -1.0]])
    lp = (prox + t64([[0.1, 0.3, 0.0], [-0.2, -0.4, -0.3]])).nan_to_num(nan=7.0).requires_grad_()
    adv = t64([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = t64([[1, 1, 0], [1, 1, 1]])
    return lp, prox, adv, mask


def test_gspo_hand_value_gradient_and_stats() -> None:
    lp, prox, adv, mask = example()
    loss, stats = policy_loss(lp, prox, None, adv, mask, clip_low=0.2, clip_high=0.28, **GSPO)
    # row 0: log s = (0.1 + 0.3) / 2 = 0.2, s = e^0.2 = 1.2214028 <= 1.28: unclipped, l = -A s = -1.2214028
    #        (token-level would clip its second token, r = e^0.3 = 1.3499 > 1.28: the sequence is judged whole)
    # row 1: log s = (-0.2 - 0.4 - 0.3) / 3 = -0.3, s = e^-0.3 = 0.7408182 < 0.8 with A = -1: clipped,
    #        l = -min(-0.7408, -0.8) = 0.8 on each token, no gradient
    # seq_mean = (-1.2214028 + 0.8) / 2 = -0.2107014
    s0, s1 = math.exp(0.2), math.exp(-0.3)
    assert loss.item() == approx((-s0 + 0.8) / 2)
    loss.backward()
    # d loss / d lp[0, t] = (1/2 rows) (1/2 tokens) (-A s0) = -s0 / 4 = -0.3053507; row 1 clipped: 0; pad: 0
    assert lp.grad.tolist() == [approx([-s0 / 4, -s0 / 4, 0.0]), approx([0.0, 0.0, 0.0])]
    assert stats["seq_clip_frac"].item() == share(0.5)  # 1 of the 2 sequences
    assert stats["clip_frac_low"].item() == share(3 / 5) and stats["clip_frac_high"].item() == 0.0  # tokens
    assert stats["ratio_mean"].item() == approx((2 * s0 + 3 * s1) / 5)  # 0.9330520: the applied s_i per token
    # approx_kl stays per token: k3 = e^-x - 1 + x for x = 0.1, 0.3, -0.2, -0.4, -0.3
    k3 = [math.expm1(-x) + x for x in (0.1, 0.3, -0.2, -0.4, -0.3)]
    assert stats["approx_kl"].item() == approx(sum(k3) / 5)


def test_sequence_log_ratio_value_and_gradient() -> None:
    lp, prox, _, mask = example()
    log_s = sequence_log_ratio(lp, prox, mask.bool())
    assert log_s.tolist() == [approx([0.2, 0.2, 0.0]), approx([-0.3, -0.3, -0.3])]
    # d log s_i,t / d lp[i, u] = 1 if u == t (the per-token gradient), else 0: sg[] cuts the mean's gradient
    (log_s[0, 0] + 2 * log_s[1, 2]).backward()
    assert lp.grad.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 2.0]]


def reference_gspo(lp, prox, adv, mask, clip_low, clip_high):
    """The paper's eq. 5-7 literally: s_i = exp(mean_t (lp - prox)) as one differentiable scalar per sequence."""
    m = mask.bool()
    terms = []
    for i in range(lp.shape[0]):
        if not m[i].any():
            continue
        s = torch.exp((lp[i][m[i]] - prox[i][m[i]]).mean())
        a = adv[i][m[i]][0]
        terms.append(-torch.minimum(s * a, s.clamp(1 - clip_low, 1 + clip_high) * a))
    return torch.stack(terms).mean()


def test_gspo_matches_the_sequence_objective_on_random_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    mask = t64([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]])  # env hole, empty row
    prox = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    lp0 = prox + 0.3 * torch.randn(4, 5, generator=gen, dtype=torch.float64)
    adv = torch.tensor([1.5, -0.7, 3.0, -2.0], dtype=torch.float64)[:, None].expand(4, 5)
    for clip in (0.05, 0.2, 10.0):  # clipped sequences, some, none
        lp, ref_lp = lp0.clone().requires_grad_(), lp0.clone().requires_grad_()
        loss, _ = policy_loss(lp, prox, None, adv, mask, clip_low=min(clip, 0.9), clip_high=clip, **GSPO)
        ref = reference_gspo(ref_lp, prox, adv, mask, min(clip, 0.9), clip)
        loss.backward()
        ref.backward()
        assert loss.item() == approx(ref.item())
        assert torch.allclose(lp.grad, ref_lp.grad, rtol=1e-12, atol=1e-15)  # float64, same sums


@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_equal_token_log_ratios_give_the_token_level_loss(dual_clip: float | None) -> None:
    # per row one log-ratio on every action token: log 1.5 (A = 1, clipped high), log 0.9 (A = -1), log 1.7 (A = -1,
    # dual-clipped at 1.5 when on): r_t = s_i everywhere, so both ratios give the same per-token terms
    prox = t64([[0.0, -1.0, -2.0], [-0.3, -0.6, 0.0], [-1.0, 0.0, 0.0]])
    x = t64([[math.log(1.5)] * 3, [math.log(0.9)] * 3, [math.log(1.7)] * 3])
    mask = t64([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    adv = t64([[1.0] * 3, [-1.0] * 3, [-1.0] * 3])
    grads = []
    losses = []
    for ratio in ("token", "sequence"):
        lp = (prox + x).requires_grad_()
        loss, _ = policy_loss(lp, prox, None, adv, mask, dual_clip=dual_clip, aggregation="seq_mean", ratio=ratio)
        loss.backward()
        losses.append(loss.item())
        grads.append(lp.grad)
    # rows: -min(1.5, 1.2) = -1.2; -min(-0.9, -0.9) = 0.9; -min(-1.7, -1.2) = 1.7 (dual: capped at 1.5)
    assert losses[0] == approx((-1.2 + 0.9 + (1.5 if dual_clip else 1.7)) / 3)
    assert losses[1] == approx(losses[0])
    assert torch.allclose(grads[0], grads[1], rtol=1e-12, atol=0)


def test_gspo_with_sequence_tis() -> None:
    lp, prox, adv, mask = example()
    # prox - behaviour: row 0 [log 1.5, log 1.2] -> w0 = min(1.8, 2) = 1.8; row 1 [0, 0, log 4] -> w1 = min(4, 2) = 2
    behaviour = prox - t64([[math.log(1.5), math.log(1.2), 0.0], [0.0, 0.0, math.log(4.0)]])
    tis = {"correction": "tis", "tis_level": "sequence", "clip_high": 0.28}
    loss, stats = policy_loss(lp, prox, behaviour, adv, mask, **tis, **GSPO)
    # rows (the clips of test_gspo_hand_value_gradient_and_stats): -1.8 e^0.2 = -2.1985250; 2 * 0.8 = 1.6;  mean = (-2.1985250 + 1.6) / 2 = -0.2992625
    assert loss.item() == approx((-1.8 * math.exp(0.2) + 1.6) / 2)
    assert stats["is_truncated_frac"].item() == share(3 / 5)  # row 1's three tokens


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"correction": "decoupled"}, "correction='tis' with tis_level='sequence'"),
        ({"correction": "tis", "tis_level": "token"}, "correction='tis' with tis_level='sequence'"),
        ({"aggregation": "token_mean"}, "use aggregation='seq_mean'"),
        ({"ratio": "per_token"}, "ratio must be one of"),
    ],
)
def test_gspo_refuses_per_token_weights_and_token_mean(kwargs: dict, expected: str) -> None:
    lp, prox, adv, mask = example()
    args = {**GSPO, **kwargs}
    with pytest.raises(ValueError, match=expected):
        policy_loss(lp, prox, prox, adv, mask, **args)
