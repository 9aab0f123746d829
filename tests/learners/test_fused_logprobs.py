"""`logprobs.linear_logprobs_entropy` (log-probs and entropies fused with the output layer) against the unfused
`logprobs_from_logits` / `entropy_from_logits` on the full logits: values and gradients w.r.t. the hidden states
and the weight, and the trainer's update on the fused path against the unfused one.

Tolerances. Both paths compute the same sums in other orders: the fused one carries the log-sum-exp across
vocabulary chunks (online max and rescaled partial sums) and writes H = log s - t / s, the unfused one takes
logsumexp and -sum p log p at once. A sum of V terms each rounded to eps relative moves by <= V eps of its
magnitude in the worst case, and the log-normaliser adds eps |max z|; an entropy or log-prob is such a sum times
values of size <= 1 + max |z|. So |value - value_ref| <= 4 V eps (1 + max |z|) per position (4: the two paths'
errors, each of two terms), and the same bound relative to max |g_ref| for a gradient (dz is those values times
a few exact factors, then one product each way that both paths take with the same blocking up to chunking).
bfloat16 inputs: both paths round the product h W^T to bfloat16 (half an ulp, 2^-9 relative) before the float32
softmax, and a different blocking of the matmul can move a logit by one bf16 ulp (2^-8 |z|), so log-probs and
entropies agree to 2 x 2^-8 max |z| (the target logit and the normaliser each move by at most one logit's
error); gradients go through two bf16 roundings more (dz, then the product): 4 x 2^-8 relative to max |g_ref|.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learners.logprobs import entropy_from_logits, linear_logprobs_entropy, logprobs_from_logits
from learners.trainer import Trainer
from tests.learners.learner_fakes import synthetic_batch
from tests.learners.test_trainer import assert_same_step, one_step

N, H, V = 37, 16, 50  # rows, hidden size, vocabulary (V not a multiple of the chunk sizes used below)
BF16_ULP = 2.0**-8


def unfused(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperature: float):
    logits = (hidden @ weight.T)[None] / temperature  # [1, N, V], in the inputs' dtype, as the model's head
    return logprobs_from_logits(logits, tokens[None])[0], entropy_from_logits(logits)[0]


def inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=generator) / 2).to(dtype).requires_grad_()  # logits of a few units
    return hidden, weight, torch.randint(0, V, (N,), generator=generator)


def values_and_gradients(fn, hidden, weight, tokens, temperature, use_entropy: bool):
    """(logprobs, entropy, d/d hidden, d/d weight) of sum a * logprobs + sum b * entropy (b = 0 without entropy)."""
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(N, generator=generator), torch.randn(N, generator=generator)
    logprobs, entropy = fn(hidden, weight, tokens, temperature)
    loss = (a.to(logprobs.dtype) * logprobs).sum()
    if use_entropy:
        loss = loss + (b.to(entropy.dtype) * entropy).sum()
    grad_hidden, grad_weight = torch.autograd.grad(loss, (hidden, weight))
    return logprobs.detach(), entropy.detach(), grad_hidden.float(), grad_weight.float()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("vocab_chunk, row_block", [(7, 5), (16, 100), (4096, 4096)])
@pytest.mark.parametrize("use_entropy", [True, False])
def test_fused_values_and_gradients_equal_the_unfused_ones(dtype, vocab_chunk, row_block, use_entropy) -> None:
    hidden, weight, tokens = inputs(dtype)
    temperature = 0.7

    def fused(h, w, t, temp):
        return linear_logprobs_entropy(h, w, t, temp, vocab_chunk=vocab_chunk, row_block=row_block)

    got = values_and_gradients(fused, hidden, weight, tokens, temperature, use_entropy)
    ref = values_and_gradients(unfused, hidden, weight, tokens, temperature, use_entropy)
    max_z = float((hidden @ weight.T).detach().abs().max()) / temperature
    bound = 4 * V * torch.finfo(dtype).eps * (1 + max_z)  # see the module docstring
    for name, value, expected in zip(("logprobs", "entropy"), got[:2], ref[:2]):
        assert value.dtype == expected.dtype and value.shape == (N,)
        assert float((value - expected).abs().max()) <= bound, name
    for name, grad, expected in zip(("d hidden", "d weight"), got[2:], ref[2:]):
        assert float(expected.abs().max()) > 0
        assert float((grad - expected).abs().max()) <= bound * float(expected.abs().max()), name


def test_fused_gradients_pass_a_finite_difference_check_in_float64() -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(11, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    tokens = torch.randint(0, 11, (6,), generator=generator)
    for output in (0, 1):  # log-probs alone, entropy alone (the other output unused: its gradient is None)

        def fn(h, w, output=output):
            return linear_logprobs_entropy(h, w, tokens, 0.7, vocab_chunk=3, row_block=4)[output]

        assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_fused_bfloat16_matches_the_unfused_bfloat16_head() -> None:
    hidden, weight, tokens = inputs(torch.bfloat16)
    got = values_and_gradients(linear_logprobs_entropy, hidden, weight, tokens, 1.0, True)
    ref = values_and_gradients(unfused, hidden, weight, tokens, 1.0, True)
    max_z = float((hidden @ weight.T).detach().float().abs().max())
    for value, expected in zip(got[:2], ref[:2]):
        assert value.dtype == torch.float32
        assert float((value - expected).abs().max()) <= 2 * BF16_ULP * max_z  # see the module docstring
    for grad, expected in zip(got[2:], ref[2:]):
        assert float((grad - expected).abs().max()) <= 4 * BF16_ULP * float(expected.abs().max())


def test_no_position_gives_empty_outputs_that_still_backpropagate() -> None:
    # a micro-batch whose every sample is out of the loss (algo.overlong = "mask"): N = 0, zero gradients, no error
    hidden = torch.zeros(0, 8, requires_grad=True)
    weight = torch.randn(16, 8, requires_grad=True)
    logprobs, entropy = linear_logprobs_entropy(hidden, weight, torch.zeros(0, dtype=torch.long), 0.7)
    assert logprobs.shape == entropy.shape == (0,) and logprobs.dtype == torch.float32
    (logprobs.sum() + entropy.sum()).backward()
    assert hidden.grad.shape == (0, 8) and weight.grad.abs().max() == 0


def test_bad_arguments_are_refused() -> None:
    hidden, weight, tokens = inputs(torch.float32)
    with pytest.raises(ValueError, match="weight"):
        linear_logprobs_entropy(hidden, weight[:, :-1], tokens)
    with pytest.raises(ValueError, match="tokens"):
        linear_logprobs_entropy(hidden, weight, tokens[:-1])
    with pytest.raises(ValueError, match="vocab_chunk"):
        linear_logprobs_entropy(hidden, weight, tokens, vocab_chunk=0)
    with pytest.raises(ValueError, match="temperature"):
        linear_logprobs_entropy(hidden, weight, tokens, temperature=0.0)
    for bad in (weight.shape[0], -1):  # one past the vocabulary, and negative: refused, not a silent wrong value
        with pytest.raises(ValueError, match=r"token ids must be in \[0, "):
            linear_logprobs_entropy(hidden, weight, torch.where(tokens == tokens[0], bad, tokens))


@pytest.mark.deepspeed
def test_the_fused_update_equals_the_unfused_one_with_the_entropy_bonus(tiny_model_dir, dist, monkeypatch) -> None:
    """Entropy bonus on (its gradient flows through the fused entropy), a temperature != 1, the tied embedding
    (its gradient is the input embedding's plus the output layer's): the same gradient and AdamW step as the
    unfused path, within test_trainer's bounds (same float32 reorderings argument)."""
    groups = synthetic_batch(0, 2, 4)
    batch = groups, [np.zeros(g.size, dtype=np.int32) for g in groups]
    settings = {"learner__zero_stage": 0, "algo__entropy_coef": 0.01, "generator__temperature": 0.7}
    fused = one_step(tiny_model_dir, dist, batch, **settings)
    module = fused.trainer.policy.module
    assert module.get_output_embeddings().weight is module.get_input_embeddings().weight  # tied
    assert fused.trainer._fused_head(fused.trainer.policy) is module.get_input_embeddings().weight  # fused path
    monkeypatch.setattr(Trainer, "_fused_head", lambda self, model: None)  # the unfused path: full logits
    reference = one_step(tiny_model_dir, dist, batch, **settings)
    assert_same_step(fused, reference)
    assert fused.stats["policy/entropy"] == pytest.approx(reference.stats["policy/entropy"], rel=1e-5)


@pytest.mark.deepspeed
def test_under_zero3_the_fused_head_runs_as_the_output_layers_forward(tiny_model_dir, dist, monkeypatch) -> None:
    """ZeRO-3 partitions the output weight: the fused function runs as the output layer's forward, where DeepSpeed
    gathers it (and again for its backward), instead of building full logits (review finding 14). Same gradient
    and step as ZeRO-3's unfused path (the tied weight's gradient too), within test_trainer's bounds."""
    from learners import completion_logprobs as paths

    groups = synthetic_batch(0, 2, 4)
    batch = groups, [np.zeros(g.size, dtype=np.int32) for g in groups]
    settings = {"learner__zero_stage": 3, "algo__entropy_coef": 0.01, "generator__temperature": 0.7}
    calls = []
    as_forward = paths._as_forward_of
    monkeypatch.setattr(paths, "_as_forward_of", lambda *args: calls.append(1) or as_forward(*args))
    fused = one_step(tiny_model_dir, dist, batch, **settings)
    assert calls, "the fused path did not run under ZeRO-3"
    assert isinstance(fused.trainer._fused_head(fused.trainer.policy), torch.nn.Linear)
    monkeypatch.setattr(Trainer, "_fused_head", lambda self, model: None)  # ZeRO-3's unfused path: full logits
    reference = one_step(tiny_model_dir, dist, batch, **settings)
    assert_same_step(fused, reference)
    assert fused.stats["policy/entropy"] == pytest.approx(reference.stats["policy/entropy"], rel=1e-5)
