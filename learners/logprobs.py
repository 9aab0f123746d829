"""Per-token log-probs and entropies from logits, or fused with the output layer from the final hidden states.

The learner's losses (`learners.losses`) take per-token log-probs and entropies; this module computes them:

    lp = logprobs_from_logits(logits, tokens)                        # [B, T, V], [B, T] -> [B, T]
    h = entropy_from_logits(logits)                                  # [B, T, V] -> [B, T]
    lp, h = linear_logprobs_entropy(hidden, lm_head.weight, tokens, temperature)   # [N, H] -> [N] each, no logits

Conventions as in `learners.losses`: natural logs of the sampled tokens, every position computed (mask the
results; masked positions may hold anything), float32 results (float64 for float64 input).

`linear_logprobs_entropy` is what the RL learner uses (`learners.trainer`): the same log-probs and entropies
from the final hidden states and the output layer's weight, chunk by chunk, so the [tokens, V] float32 logits
(0.2 GB per 1,000 tokens of a 49k vocabulary), their log-softmax and its backward never exist at once. Memory:
a few [row_block, vocab_chunk] float32 buffers, plus hidden and weight themselves (saved, not copied) and two
floats per token. Compute: one more [N, H] x [H, V] product than the unfused path (each chunk's logits are
recomputed in backward) and a few elementwise passes over each chunk. On SmolLM2's demo batch (bf16, one core)
this and the fused AdamW took a learner step from 54.0 s to 47.8 s (`benchmarks.learner_throughput`: 0.64 ->
0.70 of the core's GEMM rate). `logprobs_from_logits` and `entropy_from_logits` work on the model's full logits
(the offline stages, the unfused learner path, tests), `chunk_size` rows at a time.

Failure modes: ValueError for mismatched shapes, chunk sizes < 1 or a temperature <= 0. Token ids are not
range-checked: every position needs a valid id in [0, V), padding included (the pad id, not -100);
`logprobs_from_logits` fails on an out-of-range id with torch's index error, while `linear_logprobs_entropy`
returns a wrong log-prob (-log-normaliser) for it without an error.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["entropy_from_logits", "linear_logprobs_entropy", "logprobs_from_logits"]


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def entropy_from_logits(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """Entropy of softmax(logits) at every position: H = -sum_v p_v log p_v, [B, T, V] -> [B, T].

    Computed from log_softmax (stable for large logits; logits of -inf, e.g. masked vocabulary entries,
    contribute 0 and no NaN gradient), in float32 (float64 for float64 input), `chunk_size` rows of B*T at a
    time so that a no-grad call holds one [chunk_size, V] float32 copy at most. Under autograd each chunk's
    working tensors are kept for backward. Every position is computed; mask the result (e.g. masked_mean).
    """
    flat = logits.reshape(-1, logits.shape[-1])  # [B*T, V]
    chunks = []
    for start in range(0, flat.shape[0], chunk_size):
        logp = torch.log_softmax(flat[start : start + chunk_size].to(_compute_dtype(logits)), dim=-1)  # [c, V]
        p = logp.exp()  # [c, V]
        chunks.append(-(p * torch.where(p > 0, logp, 0)).sum(dim=-1))  # [c]
    if not chunks:
        return logits.new_zeros(logits.shape[:-1], dtype=_compute_dtype(logits))
    return torch.cat(chunks).reshape(logits.shape[:-1])


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(z)[token] row by row, chunked, saving only the input logits and the log-normalisers."""

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, chunk_size: int) -> Tensor:  # [N, V], [N] -> [N]
        dtype = _compute_dtype(logits)
        lse = logits.new_empty(logits.shape[0], dtype=dtype)  # [N]
        out = logits.new_empty(logits.shape[0], dtype=dtype)  # [N]
        for s in range(0, logits.shape[0], chunk_size):
            z = logits[s : s + chunk_size].to(dtype)  # [c, V]
            lse[s : s + chunk_size] = torch.logsumexp(z, dim=-1)
            out[s : s + chunk_size] = z.gather(1, tokens[s : s + chunk_size, None]).squeeze(1) - lse[s : s + chunk_size]
        ctx.save_for_backward(logits, tokens, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None]:  # d/dz_v = g * (1[v = token] - p_v)
        logits, tokens, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)  # [N, V] in the logits dtype
        c = ctx.chunk_size
        for s in range(0, logits.shape[0], c):
            g = grad_out[s : s + c, None].to(lse.dtype)  # [c, 1]
            d = -torch.exp(logits[s : s + c].to(lse.dtype) - lse[s : s + c, None]) * g  # [c, V]
            grad[s : s + c] = d.scatter_add_(1, tokens[s : s + c, None], g)
        return grad, None, None


class _LinearLogprobsEntropy(torch.autograd.Function):
    """(log softmax(h W^T / T)[token], entropy) by blocks of rows x chunks of the vocabulary, with an online
    log-sum-exp over the chunks; backward recomputes each chunk's logits.

    Saved for backward: hidden, weight (the tensors themselves, no copy), tokens, and [N] log-normalisers and
    entropies. Working memory: a few [row_block, vocab_chunk] float32 buffers, never [N, V]. Chunking the
    vocabulary (not only the rows) gives each weight-gradient product all rows of a block at once: the [V, H]
    gradient is written once per row block, not accumulated chunk by chunk.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float, vocab_chunk: int, rows: int):
        dtype = _compute_dtype(hidden)
        parts = [
            _online_stats(hidden[s : s + rows], weight, tokens[s : s + rows], temperature, vocab_chunk, dtype)
            for s in range(0, hidden.shape[0], rows)
        ]
        target, lse, entropy = (torch.cat(values) for values in zip(*parts))  # [N] each
        ctx.save_for_backward(hidden, weight, tokens, lse, entropy)
        ctx.temperature, ctx.vocab_chunk, ctx.rows = temperature, vocab_chunk, rows
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(tokens)
        return target - lse, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None):
        """With p = softmax(z), z = h W^T / T:  d logprob/dz_v = 1[v = token] - p_v,
        d entropy/dz_v = -p_v (log p_v + H);  then dh = dz W / T and dW = dz^T h / T."""
        hidden, weight, tokens, lse, entropy = ctx.saved_tensors
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None
        n, rows = hidden.shape[0], ctx.rows
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:  # one row block: written in place; several: summed in float32 (float64)
            grad_weight = torch.empty_like(weight) if n <= rows else torch.zeros_like(weight, dtype=lse.dtype)
        for s in range(0, n, rows):
            span = slice(s, s + rows)
            g_lp = grad_logprobs[span].to(lse.dtype) if grad_logprobs is not None else None
            g_h = grad_entropy[span].to(lse.dtype) if grad_entropy is not None else None
            dh, dw = _block_backward(
                hidden[span], weight, tokens[span], lse[span], entropy[span], g_lp, g_h, ctx, grad_weight is not None
            )
            if grad_hidden is not None:
                grad_hidden[span] = dh
            if grad_weight is not None and n <= rows:
                grad_weight = dw
            elif grad_weight is not None:
                grad_weight += dw
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _chunk_logits(hidden: Tensor, weight: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:
    """hidden @ weight.T / temperature [n, c] in `dtype`; the product in the layer's own dtype (as the model's)."""
    logits = (hidden @ weight.T).to(dtype)  # [n, c]
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def _online_stats(
    hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float, vocab_chunk: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """(target logit, log-sum-exp, entropy) [n] each over the whole vocabulary, one chunk of it at a time.

    Running over the chunks so far: the max m, s = sum exp(z - m) and t = sum exp(z - m) (z - m); then
    lse = m + log s and H = -sum p log p = log s - t / s (no cancellation between large terms: z - m <= 0).
    """
    n = hidden.shape[0]
    target = torch.zeros(n, dtype=dtype, device=hidden.device)
    m = s = t = None
    for v0 in range(0, weight.shape[0], vocab_chunk):
        z = _chunk_logits(hidden, weight[v0 : v0 + vocab_chunk], temperature, dtype)  # [n, c]
        inside = (tokens >= v0) & (tokens < v0 + z.shape[1])  # [n]
        picked = z.gather(1, (tokens - v0).clamp(0, z.shape[1] - 1)[:, None]).squeeze(1)  # [n]
        target = torch.where(inside, picked, target)
        m_new = z.amax(dim=1) if m is None else torch.maximum(m, z.amax(dim=1))  # [n]
        shifted = z.sub_(m_new[:, None])  # [n, c]  z - m_new <= 0
        e = shifted.exp()  # [n, c]
        s_chunk, t_chunk = e.sum(dim=1), e.mul_(shifted).sum(dim=1)
        if m is None:
            s, t = s_chunk, t_chunk
        else:
            scale = torch.exp(m - m_new)  # [n]  <= 1
            t = scale * (t + (m - m_new) * s) + t_chunk
            s = scale * s + s_chunk
        m = m_new
    return target, m + torch.log(s), torch.log(s) - t / s


def _block_backward(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    lse: Tensor,
    entropy: Tensor,
    g_lp: Tensor | None,
    g_h: Tensor | None,
    ctx: object,
    weight_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """(d hidden [n, H], d weight [V, H] or None) of one row block, one vocabulary chunk at a time."""
    grad_hidden = torch.zeros(hidden.shape, dtype=lse.dtype, device=hidden.device)  # [n, H]
    grad_weight = torch.empty_like(weight) if weight_grad else None
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    for v0 in range(0, weight.shape[0], ctx.vocab_chunk):
        w = weight[v0 : v0 + ctx.vocab_chunk]  # [c, H]
        logp = _chunk_logits(hidden, w, ctx.temperature, lse.dtype).sub_(lse[:, None])  # [n, c]
        grad_z = logp.exp()  # [n, c]  p
        if g_h is not None:  # -p (g_lp + g_H (log p + H))
            coef = logp.add_(entropy[:, None]).mul_(-g_h[:, None])
            if g_lp is not None:
                coef.sub_(g_lp[:, None])
            grad_z.mul_(coef)
        else:
            grad_z.mul_(-g_lp[:, None])
        if g_lp is not None:
            inside = (tokens >= v0) & (tokens < v0 + w.shape[0])
            grad_z.index_put_((rows[inside], tokens[inside] - v0), g_lp[inside], accumulate=True)
        if ctx.temperature != 1.0:
            grad_z.div_(ctx.temperature)
        grad_z = grad_z.to(weight.dtype)  # [n, c]  d loss / d (h W^T), in the layer's dtype (as autograd's)
        grad_hidden += grad_z @ w
        if grad_weight is not None:
            grad_weight[v0 : v0 + w.shape[0]] = grad_z.T @ hidden
    return grad_hidden.to(hidden.dtype), grad_weight


def linear_logprobs_entropy(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    vocab_chunk: int = 4096,
    row_block: int = 4096,
) -> tuple[Tensor, Tensor]:
    """Log-prob of each token and the entropy at each position under softmax(hidden @ weight.T / temperature),
    fused with the output layer so that the [N, V] logits never exist (Liger's fused linear cross-entropy, for
    per-token log-probs): `row_block` rows x `vocab_chunk` vocabulary entries at a time, with a log-sum-exp
    carried across the chunks, and each chunk's logits recomputed in backward.

        logprobs, entropy = linear_logprobs_entropy(hidden, lm_head.weight, tokens, temperature)   # [N], [N]

    hidden: [N, H] (the final hidden states at the positions that predict `tokens`); weight: [V, H] (the output
    layer's, bias-free; a weight tied to the input embedding gets its gradient added to the shared parameter's,
    as autograd adds any two uses); tokens: [N] integer ids in [0, V). Returns float32 [N] each (float64 for
    float64 input): logprobs[n] = log p_n(tokens[n]) and entropy[n] = -sum_v p_n(v) log p_n(v). Both are
    differentiable w.r.t. hidden and weight (a caller that does not use the entropy pays nothing for its
    gradient). The products run in the layer's dtype and the softmax in float32, as `logprobs_from_logits`
    computes them on the model's logits (one rounding apart: the temperature divides the float32 logits here).
    Cost: one more [N, H] x [H, V] product than the unfused path (the recomputation) and a few passes over
    each [row_block, vocab_chunk] float32 chunk. Raises ValueError for mismatched shapes, chunk sizes < 1 or a
    token id outside [0, V) (checked here: the chunked gather would otherwise return a wrong value silently).
    N = 0 gives two empty tensors that are still differentiable (zero gradients), so the backward runs as usual.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if tokens.shape != hidden.shape[:1]:
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}, hidden {tuple(hidden.shape)}")
    if vocab_chunk < 1 or row_block < 1:
        raise ValueError(f"vocab_chunk and row_block must be >= 1, got {vocab_chunk} and {row_block}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < weight.shape[0]:
        raise ValueError(
            f"token ids must be in [0, {weight.shape[0]}) (the output layer's rows), got "
            f"{int(tokens.min())}..{int(tokens.max())}"
        )
    if not hidden.shape[0]:  # no position (a micro-batch whose every sample is out of the loss, algo.overlong)
        empty = (hidden @ weight.t()).to(_compute_dtype(hidden)).sum(dim=1)  # [0], still in the graph of both
        return empty, empty.clone()
    return _LinearLogprobsEntropy.apply(hidden, weight, tokens.long(), float(temperature), vocab_chunk, row_block)


def logprobs_from_logits(logits: Tensor, tokens: Tensor, chunk_size: int = 1024) -> Tensor:
    """Log-prob of each token: logprobs[b, t] = z[b, t, tokens[b, t]] - logsumexp_v z[b, t, v].

    logits: [B, T, V] (any float dtype, already aligned with `tokens`, i.e. shifted by one and divided by
    the sampling temperature by the caller); tokens: [B, T] integer ids, valid (0 <= id < V) at every
    position, including padding (use the pad id, not -100). Returns [B, T] float32 (float64 for float64 logits).
    Memory: a custom autograd function works on `chunk_size` rows at a time and saves only the logits it was
    given (no copy) and one float per row, so no [B, T, V] log_softmax or float32 upcast of bf16 logits is
    kept; backward writes the [B, T, V] gradient in the logits dtype, chunk by chunk.
    """
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}, logits {tuple(logits.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat = logits.reshape(-1, logits.shape[-1])  # [B*T, V]
    out = _TokenLogprobs.apply(flat, tokens.reshape(-1).long(), chunk_size)  # [B*T]
    return out.reshape(tokens.shape)
