"""Policy and value losses and KL estimators: pure functions on torch tensors.

Same conventions as `learners.advantages`: token tensors are [B, T] (right-padded completions), `mask` is 1 on
action tokens and 0 on padding and environment tokens; masked positions may hold arbitrary values (even
inf/NaN) and contribute to no loss, statistic or gradient. Log-probs are natural logs of the sampled tokens.

Three policies appear in the asynchronous setting (staleness eta > 0):
    pi_theta      the weights being trained                       `logprobs`            (requires grad)
    pi_prox       the learner's weights before this update,       `proximal_logprobs`   (recomputed by the learner)
    pi_behaviour  the weights/engine that sampled the tokens      `behaviour_logprobs`  (returned by vLLM)
With eta = 0 and a numerically exact sampler, pi_behaviour == pi_prox and every correction is the identity.

    lp = logprobs_from_logits(logits, tokens)                                   # [B, T]  (learners.logprobs)
    loss, stats = policy_loss(lp, prox_lp, behaviour_lp, adv, mask, correction="decoupled")
    loss = loss - entropy_coef * masked_mean(entropy_from_logits(logits), mask)

The per-token log-probs and entropies themselves (from logits, or fused with the output layer so that the
[tokens, V] logits never exist: `linear_logprobs_entropy`, what the RL learner uses) are in `learners.logprobs`.

The offline stages' losses (`tandem sft`, `tandem rm`, `tandem dpo`) are here too: `sft_token_nll` on [B, T],
`bradley_terry_loss` and `dpo_loss` on one value per pair [B].
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from learners.advantages import action_mask, masked_mean

__all__ = [
    "bradley_terry_loss",
    "dpo_loss",
    "importance_mask",
    "kl_estimate",
    "policy_loss",
    "sequence_log_ratio",
    "sft_token_nll",
    "value_loss",
]

LOG_RATIO_LIMIT = 20.0  # |log pi_theta/pi_prox| is clamped here before exp: ratio in [2e-9, 5e8], never inf
_CORRECTIONS = ("none", "decoupled", "tis")
_TIS_LEVELS = ("token", "sequence")
_AGGREGATIONS = ("token_mean", "seq_mean")
_RATIOS = ("token", "sequence")
_IS_MASKS = ("none", "token", "sequence", "geometric")
_KINDS = ("ppo", "cispo", "sapo")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str, mask: Tensor) -> Tensor:
    """Per-token estimate [B, T] of KL(pi_theta || pi_ref) for tokens x sampled from pi_theta; 0 where mask == 0.

    With log r = log pi_ref(x) - log pi_theta(x) (Schulman, "Approximating KL divergence"):
        k1 = -log r                  unbiased, high variance, can be negative
        k2 = (log r)^2 / 2           biased, low variance, >= 0; its gradient is the KL's gradient
        k3 = (r - 1) - log r         unbiased, low variance, >= 0 (GRPO's KL term)
    Each has expectation ~ KL(pi_theta || pi_ref) under x ~ pi_theta (k1 and k3 exactly).
    logprobs, ref_logprobs, mask: [B, T]. Differentiable in both log-prob inputs.
    """
    m = action_mask(mask, logprobs.shape)
    log_r = torch.where(m, ref_logprobs - logprobs, 0)  # [B, T]  log pi_ref/pi_theta
    if kind == "k1":
        kl = -log_r
    elif kind == "k2":
        kl = 0.5 * log_r**2
    elif kind == "k3":
        kl = torch.expm1(log_r) - log_r
    else:
        raise ValueError(f"kind must be 'k1', 'k2' or 'k3', got {kind!r}")
    return torch.where(m, kl, 0)


def _aggregate(per_token: Tensor, m: Tensor, aggregation: str) -> Tensor:
    """token_mean: sum over all action tokens / their number. seq_mean: mean over each row's action tokens,
    then mean over the rows that have at least one (empty rows are left out). No action token at all: 0."""
    if aggregation == "token_mean":
        return per_token.sum() / m.sum().clamp(min=1)
    counts = m.sum(dim=1)  # [B]
    row_means = per_token.sum(dim=1) / counts.clamp(min=1)  # [B]  0 for empty rows
    return row_means.sum() / (counts > 0).sum().clamp(min=1)


def sequence_log_ratio(logprobs: Tensor, proximal_logprobs: Tensor, m: Tensor) -> Tensor:
    """GSPO's token-form log-ratio [B, T] (Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 11-13):
        log s_i   = mean over row i's action tokens of (log pi_theta - log pi_prox)     (length-normalised)
        log s_i,t = sg[log s_i] + log pi_theta(y_t) - sg[log pi_theta(y_t)]
    Its value is log s_i on every action token of the row (the added difference is exactly 0), and
    d s_i,t / d log pi_theta(y_t) = s_i: the gradient stays per token, scaled by the sequence's ratio, which with a
    mean over the row's tokens is GSPO's gradient s_i A_i (1/|y_i|) sum_t grad log pi_theta(y_t). m: bool [B, T];
    0 off the action tokens (and in empty rows). logprobs carries the gradient; proximal_logprobs is a constant."""
    per_token = torch.where(m, logprobs - proximal_logprobs.detach(), 0)  # [B, T]
    counts = m.sum(dim=1, keepdim=True).clamp(min=1)  # [B, 1]
    log_s = (per_token.sum(dim=1, keepdim=True) / counts).detach()  # [B, 1]
    return torch.where(m, log_s + logprobs - logprobs.detach(), 0)  # [B, T]


def importance_mask(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, m: Tensor, kind: str, low: float, high: float
) -> Tensor:
    """bool [B, T]: the action tokens kept by rejection on rho = pi_prox / pi_behaviour (False off `m`).

    With log rho_t = proximal_logprobs - behaviour_logprobs on row i's action tokens (m: bool [B, T]):
        "token"      keep token t    iff low <= rho_t <= high                       (IcePop's two-sided band)
        "sequence"   keep all of row i iff low <= prod_t rho_t <= high               (the product: the whole
                     sequence's likelihood ratio; it grows with length, so long rows leave the band first)
        "geometric"  keep all of row i iff low <= exp(mean_t log rho_t) <= high       (length-normalised)
    Compared in log space (log low <= stat <= log high; bounds inclusive), so a product of thousands of ratios
    never overflows. A NaN ratio on an action token is outside every band: rejected (its row too, for the
    sequence kinds). Off `m` the inputs may hold anything (inf/NaN). No gradient: it is a selection.
    With low = 1/c, high = c, "token" rejects each token whose ratio lies outside [1/c, c].

    Followed: veRL's rollout correction (`rollout_corr_helper.compute_rollout_rejection_mask`, rollout_rs =
    token / sequence / geometric, a two-sided band whose lower bound defaults to 1/upper; Liu, Li et al. 2025,
    "When Speed Kills Stability"), OpenRLHF's `vllm_is_correction_type` = "icepop" (token band) and
    "seq-mask-tis" (geometric band), TRL's `vllm_importance_sampling_mode` = token_mask / sequence_mask (an
    upper bound only, i.e. low -> 0). Raises ValueError for an unknown kind ("none" is `policy_loss`'s, not this one's).
    """
    if kind not in _IS_MASKS[1:]:
        raise ValueError(f"kind must be one of {_IS_MASKS[1:]}, got {kind!r}")
    log_rho = torch.where(m, proximal_logprobs - behaviour_logprobs, 0).detach()  # [B, T]
    stat = log_rho  # [B, T]  the quantity the band is applied to, per token
    if kind != "token":
        stat = log_rho.sum(dim=1, keepdim=True)  # [B, 1]  log prod_t rho_t
        if kind == "geometric":
            stat = stat / m.sum(dim=1, keepdim=True).clamp(min=1)  # [B, 1]  mean_t log rho_t
        stat = stat.expand_as(log_rho)  # [B, T]
    return m & (stat >= math.log(low)) & (stat <= math.log(high))


def _importance_weight(
    proximal: Tensor, behaviour: Tensor | None, m: Tensor, correction: str, tis_level: str, tis_cap: float
) -> tuple[Tensor, Tensor]:
    """Detached weights w = min(pi_prox/pi_behaviour, tis_cap) [B, T] and where they were truncated [B, T]."""
    if correction == "none" or behaviour is None:  # behaviour is not None otherwise (_check_policy_args)
        return m.to(proximal.dtype), torch.zeros_like(m)
    log_w = torch.where(m, proximal - behaviour, 0).detach()  # [B, T]
    if tis_level == "sequence":
        log_w = torch.where(m, log_w.sum(dim=1, keepdim=True), 0)  # [B, T]  product over the row
    log_cap = math.log(tis_cap)
    w = torch.exp(log_w.clamp(max=log_cap))  # [B, T]  never inf
    return torch.where(m, w, 0), m & (log_w > log_cap)


def _check_policy_args(
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    correction: str,
    tis_level: str,
    tis_cap: float,
    aggregation: str,
    has_behaviour: bool,
    ratio: str = "token",
    is_mask: str = "none",
    is_mask_low: float = 0.5,
    is_mask_high: float = 2.0,
    kind: str = "ppo",
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
) -> None:
    """Raises ValueError naming the argument to change. ratio="sequence" (GSPO) takes one weight per sequence
    (correction "none", or "tis" at tis_level "sequence"), its sequence mean (aggregation "seq_mean") and keeps or
    rejects whole sequences (is_mask "none", "sequence" or "geometric"). kind "cispo" and "sapo" are token-level
    losses with no dual clip."""
    if not 0.0 <= clip_low <= 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    if kind != "ppo" and (ratio != "token" or dual_clip is not None):
        raise ValueError(f"kind={kind!r} is a token-level loss with its own bound: use ratio='token', dual_clip=None")
    if not (sapo_tau_pos > 0.0 and sapo_tau_neg > 0.0):
        raise ValueError(f"sapo_tau_pos and sapo_tau_neg must be > 0, got {sapo_tau_pos}, {sapo_tau_neg}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    for name, value, allowed in (
        ("correction", correction, _CORRECTIONS),
        ("tis_level", tis_level, _TIS_LEVELS),
        ("aggregation", aggregation, _AGGREGATIONS),
        ("ratio", ratio, _RATIOS),
        ("is_mask", is_mask, _IS_MASKS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if correction == "decoupled" and tis_level != "token":
        raise ValueError("decoupled PPO weights each token; use correction='tis' for tis_level='sequence'")
    if ratio == "sequence" and (correction == "decoupled" or (correction == "tis" and tis_level == "token")):
        raise ValueError(
            "ratio='sequence' takes one importance weight per sequence: correction='tis' with "
            "tis_level='sequence', or correction='none'"
        )
    if ratio == "sequence" and aggregation != "seq_mean":
        raise ValueError("ratio='sequence' (GSPO) averages each sequence's loss: use aggregation='seq_mean'")
    if correction != "none" and not has_behaviour:
        raise ValueError(f"correction={correction!r} needs behaviour_logprobs")
    if not tis_cap > 0.0:
        raise ValueError(f"tis_cap must be > 0 (math.inf for no truncation), got {tis_cap}")
    if not 0.0 < is_mask_low < 1.0 < is_mask_high:
        raise ValueError(
            f"need 0 < is_mask_low < 1 < is_mask_high (the band must hold rho = 1), got {is_mask_low}, {is_mask_high}"
        )
    if is_mask != "none" and not has_behaviour:
        raise ValueError(f"is_mask={is_mask!r} needs behaviour_logprobs (the ratio is pi_prox / pi_behaviour)")
    if ratio == "sequence" and is_mask == "token":
        raise ValueError(
            "ratio='sequence' (GSPO) keeps or rejects whole sequences: is_mask='token' would drop tokens from inside "
            "a sequence's ratio; use is_mask='sequence' or 'geometric'"
        )


def policy_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    correction: str = "none",
    tis_level: str = "token",
    tis_cap: float = 2.0,
    aggregation: str = "token_mean",
    ratio: str = "token",
    is_mask: str = "none",
    is_mask_low: float = 0.5,
    is_mask_high: float = 2.0,
    kind: str = "ppo",
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss (scalar, differentiable in `logprobs`) and its statistics.

    Per action token, with r = pi_theta/pi_prox = exp(logprobs - proximal_logprobs) and advantage A:
        l = -w * min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)              (PPO; clip-higher if high > low)
        dual clip (A < 0 only): l = -w * max(min(r A, clip(r) A), dual_clip * A), i.e. capped at dual_clip |A|
    and w, always detached, by `correction`:
        "none"       w = 1. Plain PPO: pass the old (rollout-time) log-probs as proximal_logprobs.
        "decoupled"  w = min(pi_prox/pi_behaviour, tis_cap) per token: decoupled PPO (Hilton et al. 2022;
                     AReaL) where the trust region is around pi_prox and w corrects for the stale sampler.
        "tis"        truncated importance sampling against vLLM's behaviour log-probs (Yao et al. 2025):
                     tis_level="token": w_t = min(pi_prox(x_t)/pi_behaviour(x_t), tis_cap), the same numbers as
                     "decoupled"; tis_level="sequence": w = min(prod_t pi_prox/pi_behaviour, tis_cap) over
                     the row's action tokens (exp of the summed log ratio), shared by all its tokens.
    kind replaces the clipped surrogate -min(r A, clip(r) A) (the w, aggregation, is_mask and statistics below
    apply to all three):
        "ppo"    the clipped surrogate above.
        "cispo"  CISPO (MiniMax-M1, Chen et al. 2025, eq. 4): l = -sg(clip(r, 1 - clip_low, 1 + clip_high)) A log pi,
                 so d l / d log pi_theta = -clip(r) A: the ratio is clipped in the WEIGHT, and every token keeps
                 its gradient (PPO's clip drops the tokens it clips). Computed as -sg(clip(r)) A exp(lp - sg(lp)):
                 the same gradient, and the value -clip(r) A, PPO's surrogate value inside the band (the
                 paper's form would log -clip(r) A log pi, a number with no meaning). clip_low = 1 removes the
                 lower bound (the paper tunes only the upper one; TRL's cispo clamps only max).
        "sapo"   SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"): l = -A (4 / tau) sigmoid(tau (r - 1)),
                 tau = sapo_tau_pos where A > 0, sapo_tau_neg elsewhere. d l / d log pi_theta =
                 -A g r with the soft gate g = 4 sigmoid(x) (1 - sigmoid(x)), x = tau (r - 1): g = 1 at r = 1 (the
                 on-policy gradient) and decays smoothly as r leaves 1, instead of a hard band; tau_neg > tau_pos
                 decays negative updates faster (the paper's 1.05 vs 1.0, TRL's defaults). clip_low/high unused.
                 Its value at r = 1 is -2 A / tau (the gate's own scale), not PPO's -A; the gradient is the same.
    Both need ratio="token" and dual_clip=None.
    Aggregation: "token_mean" = sum of l over every action token of the batch / number of action tokens;
    "seq_mean" = mean of l over each row's action tokens, then mean over the rows with >= 1 action token
    (empty rows are skipped, never NaN). With no action token at all the loss is 0.
    log r is clamped to +-LOG_RATIO_LIMIT before exp (no inf; zero gradient beyond it).
    ratio="sequence" is GSPO (`sequence_log_ratio`): r on every token of row i is the row's length-normalised
    s_i = exp(mean_t log pi_theta/pi_prox), so the clip (and dual clip) acts on the whole sequence at once, with one
    advantage per sequence; it needs aggregation="seq_mean" and a per-sequence weight w (correction "none", or
    "tis" with tis_level="sequence"), else ValueError. With every token's log-ratio equal within each row it gives
    the token-level loss's value.

    is_mask (rejection on rho = pi_prox / pi_behaviour, `importance_mask`; "none" = off): "token" rejects each
    token whose rho_t lies outside [is_mask_low, is_mask_high], "sequence" / "geometric" whole rows whose product
    / geometric-mean ratio does. A rejected token is treated as if it had not been sampled: no loss, no gradient,
    and it leaves the denominator (token_mean divides by the KEPT action tokens, seq_mean by the rows with >= 1
    kept token); w (`correction`, truncation) still applies to the kept tokens, and tis_level="sequence" takes its
    product over the kept tokens only. With no action token outside the band the loss equals the unmasked loss
    exactly. The denominator differs between frameworks: veRL's rollout_rs multiplies the rejection into the
    response mask its aggregation divides by (rejected tokens leave the count, as here); OpenRLHF's icepop /
    seq-mask-tis and TRL's token_mask / sequence_mask set the weight to 0 and keep dividing by every action token,
    so the step shrinks by the kept share as the mismatch grows. Tandem follows veRL: rejection sampling means the
    token was not drawn, and the step's scale should not depend on how many were rejected (`algo.overlong` =
    "mask" counts the same way). ratio="sequence" with is_mask="token" is refused (ValueError): GSPO's ratio is a
    mean over the whole sequence. is_mask != "none" needs behaviour_logprobs; 0 < is_mask_low < 1 < is_mask_high.

    Shapes: logprobs, proximal_logprobs, behaviour_logprobs (None allowed with correction="none"), advantages,
    mask: [B, T]. Sample-level advantages go through `advantages.broadcast_to_tokens` first.
    Stats (detached 0-d tensors over the batch's action tokens; the caller adds a namespace such as "policy/"):
        clip_frac_low / clip_frac_high  tokens whose clipped branch is active (gradient cut): A < 0 and
                                        r < 1 - clip_low / A > 0 and r > 1 + clip_high; clip_frac = their sum
        dual_clip_frac                  tokens where the dual-clip cap is active (A < 0, r > dual_clip)
        is_weight_mean/max/min, is_truncated_frac   the applied w, and tokens where truncation changed it
        approx_kl                       mean of k3 between pi_theta and pi_prox: (pi_prox/pi_theta - 1) - log(...)
                                        (per token, whatever `ratio`)
        ratio_mean                      mean of r (the applied one: s_i per token with ratio="sequence")
        is_masked_frac                  share of the action tokens rejected by is_mask (0 with "none")
        is_masked_seq_frac              share of the rows with >= 1 action token that have >= 1 rejected token
        sapo_gate_mean                  kind="sapo" only: mean of the soft gate g (1 = on-policy gradient)
        (kind="cispo": clip_frac_low / _high count the tokens whose WEIGHT was clipped, r < 1 - clip_low /
        r > 1 + clip_high, whatever the sign of A; they keep a gradient. kind="sapo": both are 0, no hard clip)
        seq_clip_frac                   ratio="sequence" only: share of the rows with >= 1 action token whose
                                        clipped branch is active (A < 0 and s_i < 1 - clip_low, or A > 0 and
                                        s_i > 1 + clip_high)
    Every statistic but the two is_masked ones is over the KEPT action tokens (the ones the loss uses); those two
    are over all action tokens / rows. With is_mask="none" the kept tokens are the action tokens.
    """
    _check_policy_args(
        clip_low,
        clip_high,
        dual_clip,
        correction,
        tis_level,
        tis_cap,
        aggregation,
        behaviour_logprobs is not None,
        ratio,
        is_mask,
        is_mask_low,
        is_mask_high,
        kind,
        sapo_tau_pos,
        sapo_tau_neg,
    )
    m = action_mask(mask, logprobs.shape)
    for name, x in (
        ("proximal_logprobs", proximal_logprobs),
        ("behaviour_logprobs", behaviour_logprobs),
        ("advantages", advantages),
    ):
        if x is not None and x.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, logprobs {tuple(logprobs.shape)}")
    adv = torch.where(m, advantages, 0).detach()  # [B, T]
    log_ratio = torch.where(m, logprobs - proximal_logprobs.detach(), 0)  # [B, T]
    log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    applied = log_ratio
    if ratio == "sequence":
        applied = sequence_log_ratio(logprobs, proximal_logprobs, m).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if kind == "ppo":
        pg, dual_active = _ppo_surrogate(applied, adv, m, clip_low, clip_high, dual_clip)
    elif kind == "cispo":
        pg, dual_active = _cispo_surrogate(applied, adv, clip_low, clip_high), torch.zeros_like(m)
    else:
        pg, dual_active = _sapo_surrogate(applied, adv, sapo_tau_pos, sapo_tau_neg), torch.zeros_like(m)
    kept = m  # [B, T]  the action tokens the loss uses
    if is_mask != "none":
        kept = importance_mask(proximal_logprobs, behaviour_logprobs, m, is_mask, is_mask_low, is_mask_high)
    w, truncated = _importance_weight(proximal_logprobs, behaviour_logprobs, kept, correction, tis_level, tis_cap)
    per_token = torch.where(kept, w * pg, 0)  # [B, T]
    loss = _aggregate(per_token, kept, aggregation)
    stats = _policy_stats(
        kept, adv, log_ratio, applied.detach(), w, truncated, dual_active & kept, clip_low, clip_high, kind
    )
    if kind == "sapo":
        stats["sapo_gate_mean"] = masked_mean(_sapo_gate(applied.detach(), adv, sapo_tau_pos, sapo_tau_neg), kept)
    stats |= _mask_stats(m, kept)
    if ratio == "sequence":
        stats["seq_clip_frac"] = _sequence_clip_frac(kept, adv, applied.detach(), clip_low, clip_high)
    return loss, stats


def _ppo_surrogate(
    log_r: Tensor, adv: Tensor, m: Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor]:
    """PPO's -min(r A, clip(r) A) per token [B, T] (capped at dual_clip |A| for A < 0), and where that cap acts."""
    r = torch.exp(log_r)  # [B, T]
    pg = torch.maximum(-adv * r, -adv * r.clamp(1.0 - clip_low, 1.0 + clip_high))  # [B, T]
    dual_active = torch.zeros_like(m)
    if dual_clip is not None:
        dual_active = m & (adv < 0) & (pg > -dual_clip * adv)
        pg = torch.where(dual_active, -dual_clip * adv, pg)
    return pg, dual_active


def _cispo_surrogate(log_r: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """CISPO's per-token loss [B, T]: value -clip(r) A, gradient -clip(r) A d log pi_theta (`policy_loss`)."""
    weight = torch.exp(log_r.detach()).clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]  sg(clip(r))
    return -adv * weight * torch.exp(log_r - log_r.detach())  # exp(...) = 1, with d/d log pi = 1


def _sapo_surrogate(log_r: Tensor, adv: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """SAPO's per-token loss [B, T]: -A (4 / tau) sigmoid(tau (r - 1)), tau by the sign of A (`policy_loss`)."""
    tau = _sapo_tau(log_r, adv, tau_pos, tau_neg)
    return -adv * (4.0 / tau) * torch.sigmoid(tau * torch.expm1(log_r))


def _sapo_tau(log_r: Tensor, adv: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """SAPO's temperature per token [B, T], in log_r's dtype: tau_pos where A > 0, tau_neg elsewhere."""
    return torch.full_like(log_r, tau_neg, requires_grad=False).masked_fill(adv > 0, tau_pos)


@torch.no_grad()
def _sapo_gate(log_r: Tensor, adv: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """SAPO's soft gate g = 4 sigmoid(x) (1 - sigmoid(x)), x = tau (r - 1) [B, T]: its gradient / the on-policy one."""
    s = torch.sigmoid(_sapo_tau(log_r, adv, tau_pos, tau_neg) * torch.expm1(log_r))
    return 4.0 * s * (1.0 - s)


@torch.no_grad()
def _mask_stats(m: Tensor, kept: Tensor) -> dict[str, Tensor]:
    """is_masked_frac (rejected / action tokens) and is_masked_seq_frac (rows with a rejected token / rows with
    >= 1 action token); m, kept: bool [B, T], kept within m. 0 when there is no action token."""
    rejected = m & ~kept  # [B, T]
    rows = m.any(dim=1)  # [B]
    return {
        "is_masked_frac": rejected.sum() / m.sum().clamp(min=1),
        "is_masked_seq_frac": rejected.any(dim=1).sum() / rows.sum().clamp(min=1),
    }


@torch.no_grad()
def _policy_stats(
    m: Tensor,
    adv: Tensor,
    log_ratio: Tensor,
    applied_log_ratio: Tensor,
    w: Tensor,
    truncated: Tensor,
    dual_active: Tensor,
    clip_low: float,
    clip_high: float,
    kind: str = "ppo",
) -> dict[str, Tensor]:
    """The statistics documented in `policy_loss`; all inputs [B, T], already zero where m is False.
    log_ratio is per token (for approx_kl); applied_log_ratio is the one the clip saw (the same for ratio="token")."""
    n = m.sum().clamp(min=1)
    ratio = torch.exp(applied_log_ratio)  # [B, T]
    low, high = m & (ratio < 1.0 - clip_low), m & (ratio > 1.0 + clip_high)  # outside the band
    if kind == "ppo":  # the clipped branch is active (and the gradient cut) only on the side A pushes towards
        low, high = low & (adv < 0), high & (adv > 0)
    elif kind == "sapo":  # no hard band
        low, high = torch.zeros_like(m), torch.zeros_like(m)
    clip_low_frac = low.sum() / n
    clip_high_frac = high.sum() / n
    w_max = torch.where(m, w, -math.inf).max()
    w_min = torch.where(m, w, math.inf).min()
    stats = {
        "clip_frac": clip_low_frac + clip_high_frac,
        "clip_frac_low": clip_low_frac,
        "clip_frac_high": clip_high_frac,
        "dual_clip_frac": dual_active.sum() / n,
        "is_weight_mean": masked_mean(w, m),
        "is_weight_max": torch.where(m.any(), w_max, 0),
        "is_weight_min": torch.where(m.any(), w_min, 0),
        "is_truncated_frac": truncated.sum() / n,
        "approx_kl": masked_mean(torch.expm1(-log_ratio) + log_ratio, m),
        "ratio_mean": masked_mean(ratio, m),
    }
    return {k: v.detach() for k, v in stats.items()}


@torch.no_grad()
def _sequence_clip_frac(m: Tensor, adv: Tensor, log_s: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """Share of the rows with >= 1 action token whose (sequence-level) clip is active; inputs [B, T], 0 off m."""
    s = torch.exp(log_s)  # [B, T]  s_i on every action token of row i
    clipped = m & (((adv < 0) & (s < 1.0 - clip_low)) | ((adv > 0) & (s > 1.0 + clip_high)))  # [B, T]
    rows = m.any(dim=1)  # [B]
    return clipped.any(dim=1).sum() / rows.sum().clamp(min=1)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.2,
    aggregation: str = "token_mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped value loss (scalar, differentiable in `values`) and {"clip_frac"}.

    Per action token: v_c = old + clip(v - old, -clip, clip);  l = 1/2 max((v - R)^2, (v_c - R)^2),
    aggregated like `policy_loss` (token_mean or seq_mean). clip=None: l = 1/2 (v - R)^2.
    clip_frac: fraction of action tokens where the clipped term is the larger (gradient cut).
    values, old_values, returns, mask: [B, T]; old_values and returns are treated as constants.
    """
    if aggregation not in _AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {_AGGREGATIONS}, got {aggregation!r}")
    m = action_mask(mask, values.shape)
    v = torch.where(m, values, 0)  # [B, T]
    old = torch.where(m, old_values, 0).detach()  # [B, T]
    ret = torch.where(m, returns, 0).detach()  # [B, T]
    err = (v - ret) ** 2  # [B, T]
    clipped_active = torch.zeros_like(m)
    if clip is not None:
        err_clipped = (old + (v - old).clamp(-clip, clip) - ret) ** 2  # [B, T]
        clipped_active = m & (err_clipped > err)
        err = torch.maximum(err, err_clipped)
    loss = 0.5 * _aggregate(torch.where(m, err, 0), m, aggregation)
    return loss, {"clip_frac": (clipped_active.sum() / m.sum().clamp(min=1)).detach()}


# ------------------------------------------------------------------------- offline stages (SFT, RM, DPO)

_DPO_KINDS = ("sigmoid", "ipo")


def sft_token_nll(logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-row SUM [B] of -log p over the loss tokens: nll_b = -sum_t mask[b, t] * logprobs[b, t].

    logprobs: [B, T] log-probs of the target tokens (`learners.logprobs.logprobs_from_logits`); mask: [B, T] bool
    or 0/1, True on the assistant tokens (`learners.offline.data.tokenize_chat`), False on prompt, user turns and
    padding (those positions may hold anything, even inf/NaN, and get no gradient). A sum, not a mean: the caller
    divides by the loss tokens of the whole global batch, so micro-batches and ranks add up to one token mean. A
    row with no loss token gives 0.
    """
    m = action_mask(mask, logprobs.shape)
    return -torch.where(m, logprobs, 0).sum(dim=1)


def _check_pairs(**tensors: Tensor) -> None:
    """Raises ValueError unless every tensor is 1-D [B] with the same B."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 1 or any(shape != first for shape in shapes.values()):
        raise ValueError(f"expected 1-D tensors [B] of one shape (one value per pair), got {shapes}")


def bradley_terry_loss(chosen: Tensor, rejected: Tensor, margin: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Bradley-Terry loss per pair [B] and its statistics, for reward-model training.

        loss_b = -log sigmoid(r_chosen - r_rejected - margin)          (= softplus(-(r_c - r_r - m)), stable)

    The model's P(chosen > rejected) = sigmoid(r_c - r_r) (Bradley & Terry 1952; InstructGPT, Ouyang et al. 2022);
    `margin` m >= 0 asks the chosen reply to win by m (Llama 2's margin term, Touvron et al. 2023). Differentiable
    in both scores: d loss / d r_c = -sigmoid(-(r_c - r_r - m)) < 0, so raising the chosen score lowers the loss.
    chosen, rejected: [B] scalar rewards of each pair's two replies. Per-pair stats (detached, [B]; the caller
    averages): "accuracy" = 1.0 where r_c > r_r (ties count 0), "margin" = r_c - r_r.
    Raises ValueError for mismatched shapes or a negative margin.
    """
    _check_pairs(chosen=chosen, rejected=rejected)
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    diff = chosen - rejected  # [B]
    loss = torch.nn.functional.softplus(-(diff - margin))  # [B]
    d = diff.detach()
    return loss, {"accuracy": (d > 0).to(d.dtype), "margin": d}


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
    kind: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO loss per pair [B] (differentiable in the policy inputs; the reference inputs are constants) and stats.

    Inputs [B] are log-probs of each pair's replies given the prompt, under the policy and the frozen reference:
    sums over the reply tokens for kind="sigmoid", per-token MEANS for kind="ipo" (as the IPO paper and TRL's
    DPOTrainer do; the caller chooses). With h = (pc - pr) - (rc - rr), the policy's log-ratio gain over the
    reference, and e = label_smoothing:
        sigmoid  loss = -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)
                 e = 0: DPO (Rafailov et al. 2023, eq. 7); e > 0: conservative DPO (cDPO, Mitchell 2023), the
                 expected loss when a share e of the pairs is mislabelled (chosen and rejected swapped)
        ipo      loss = (h - 1/(2 beta))^2   (IPO, Azar et al. 2023, eq. 17): minimum 0 at h = 1/(2 beta), so
                 the log-ratio gap is pulled to a finite target instead of to infinity
    TRL's `DPOTrainer.dpo_loss` ("sigmoid" with label_smoothing, "ipo") computes the same numbers.
    Per-pair stats (detached, [B]): "reward_chosen" = beta (pc - rc), "reward_rejected" = beta (pr - rr) (the
    implicit rewards), "accuracy" = 1.0 where reward_chosen > reward_rejected, "margin" = their difference (beta h).
    Raises ValueError for mismatched shapes, beta <= 0, an unknown kind, label_smoothing outside [0, 0.5), or
    label_smoothing with kind="ipo".
    """
    _check_pairs(
        policy_chosen=policy_chosen, policy_rejected=policy_rejected, ref_chosen=ref_chosen, ref_rejected=ref_rejected
    )
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if kind not in _DPO_KINDS:
        raise ValueError(f"kind must be one of {_DPO_KINDS}, got {kind!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and kind != "sigmoid":
        raise ValueError("label_smoothing (cDPO) applies to kind='sigmoid' only")
    ref_chosen, ref_rejected = ref_chosen.detach(), ref_rejected.detach()
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)  # [B]
    if kind == "sigmoid":
        logsig = torch.nn.functional.logsigmoid
        loss = -(1.0 - label_smoothing) * logsig(beta * h) - label_smoothing * logsig(-beta * h)  # [B]
    else:
        loss = (h - 1.0 / (2.0 * beta)) ** 2  # [B]
    reward_chosen = beta * (policy_chosen - ref_chosen).detach()  # [B]
    reward_rejected = beta * (policy_rejected - ref_rejected).detach()  # [B]
    stats = {
        "reward_chosen": reward_chosen,
        "reward_rejected": reward_rejected,
        "accuracy": (reward_chosen > reward_rejected).to(reward_chosen.dtype),
        "margin": reward_chosen - reward_rejected,
    }
    return loss, stats
