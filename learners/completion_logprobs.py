"""Log-probs and entropies of the completion tokens under a causal LM (the policy, the reference), one forward each,
the output layer fused with the softmax when it can be (used by `learners.trainer`).

    head = fused_head(module, zero3)              # [V, H]; the output layer itself under ZeRO-3; None: unfused
    logprobs, entropy = completion_logprobs(model, inputs, temperature, head, entropy_grad)   # [b, T'] each

Fused (`head` given): the backbone's final hidden states at the positions that predict the action tokens
(loss_mask), [N, H], go through the output layer's weight in `learners.logprobs.linear_logprobs_entropy`, so the
[b, T', V] logits never exist; both outputs are 0 off the loss mask. Under ZeRO-3 the weight is partitioned and
exists whole only inside its module's forward (DeepSpeed gathers it there, and again for that module's backward),
so the fused function runs AS the output layer's forward, once (`_as_forward_of`), and DeepSpeed's hooks gather,
release and reduce its gradient as for any layer. Unfused (`fused_head` says why not): the model's logits, then `logprobs_from_logits` and `entropy_from_logits`
at every position. Off the loss mask the values are not to be used either way. Both divide the logits by the
sampling temperature, so that the log-probs match the behaviour log-probs the generator recorded.
"""

from __future__ import annotations

from typing import Any

import torch

from learners.batching import ModelInputs
from learners.logprobs import entropy_from_logits, linear_logprobs_entropy, logprobs_from_logits

_NO_POSITIONS = torch.zeros(0, dtype=torch.long)  # logits_to_keep: the output layer runs on no position
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")  # configs whose logits != h W^T


def fused_head(module: Any, zero3: bool) -> torch.Tensor | torch.nn.Module | None:
    """The output layer's weight [V, H] when `completion_logprobs` may bypass the layer; under ZeRO-3 the layer
    itself (its weight is partitioned: see the module docstring); None when the model's logits are more than
    `hidden @ weight.T` (a bias, or a config that scales or soft-caps them). `module`: the HF model."""
    head = module.get_output_embeddings()
    config = module.config
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    if any(getattr(config, name, None) for name in _LOGIT_TRANSFORMS):
        return None
    return head if zero3 else head.weight


def completion_logprobs(
    model: Any, inputs: ModelInputs, temperature: float, head: torch.Tensor | torch.nn.Module | None, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [b, T'], entropies [b, T']) of the completion tokens under softmax(logits / temperature), from
    one forward of `model` (an HF model or a DeepSpeed engine), fused when `head` (`fused_head`) is given. The
    entropy carries a gradient only when `entropy_grad` (the entropy bonus is on)."""
    if head is None:
        out = model(**inputs.forward_kwargs(), logits_to_keep=inputs.keep, use_cache=False)
        logits = inputs.predicting(out.logits) / temperature  # [b, T', V]
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits)  # [b, T']
        return logprobs_from_logits(logits, inputs.completion_tokens), entropy
    # no logits at all (an empty index); the final hidden states come back through the model's own forward (a
    # DeepSpeed engine's, whose output hooks start its backward) with the final norm applied
    out = model(**inputs.forward_kwargs(), logits_to_keep=_NO_POSITIONS, output_hidden_states=True, use_cache=False)
    mask = inputs.loss_mask  # [b, T']
    hidden = inputs.predicting(out.hidden_states[-1])[mask]  # [N, H]: the positions that predict the tokens
    tokens = inputs.completion_tokens[mask]
    if isinstance(head, torch.nn.Module):
        logprobs, entropy = _as_forward_of(head, hidden, tokens, temperature)
    else:
        logprobs, entropy = linear_logprobs_entropy(hidden, head, tokens, temperature)
    if not entropy_grad:
        entropy = entropy.detach()
    zeros = torch.zeros(mask.shape, dtype=logprobs.dtype, device=mask.device)
    return zeros.masked_scatter(mask, logprobs), zeros.masked_scatter(mask, entropy)


def _as_forward_of(
    layer: torch.nn.Linear, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear_logprobs_entropy(hidden, layer.weight, ...)` called as `layer`'s forward: a ZeRO-3 engine's hooks on
    the layer gather its weight around the call and again before its backward, then reduce the weight's gradient
    (a tied weight's too: the embedding and the output layer share the one parameter, as on the unfused path)."""
    layer.forward = lambda h: linear_logprobs_entropy(h, layer.weight, tokens, temperature)  # shadows the class's
    try:
        return layer(hidden)
    finally:
        del layer.forward
