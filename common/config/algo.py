"""`[algo]`: the RL algorithm: estimator, staleness bound, off-policy correction, clipping, KL."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from common.config.base import GROUP_ESTIMATORS, KL_IN_REWARD_ESTIMATORS, _Section


class AlgoConfig(_Section):
    """The RL algorithm: estimator, staleness bound, off-policy correction, clipping, KL."""

    estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"] = Field(
        "grpo", description="Advantage estimator; `gae` is PPO with a critic."
    )
    group_size: int = Field(8, description="Samples per prompt (n).", ge=1, le=1024)
    max_staleness: int = Field(
        2, description="η: no trained sample is more than this many policy versions old. 0 = synchronous.", ge=0
    )
    correction: Literal["none", "decoupled", "tis"] = Field(
        "tis", description="Off-policy correction against the behaviour log-probs vLLM returned."
    )
    tis_level: Literal["token", "sequence"] = Field(
        "token", description="Importance weight per token or sequence; `sequence` only with correction = `tis`."
    )
    tis_cap: float = Field(2.0, description="Importance weights are truncated at this value.", gt=0)
    is_mask: Literal["none", "token", "sequence", "geometric"] = Field(
        "none",
        description="Reject (mask) what the vLLM-trainer mismatch put too far off: rho = pi_prox / pi_behaviour "
        "outside [is_mask_low, is_mask_high]. `token`: each such token (IcePop); `sequence`: whole sequences whose "
        "product of ratios is outside (long ones leave first); `geometric`: whole sequences whose geometric-mean "
        "ratio is outside (length-normalised: the one for long completions). A rejected token adds no loss, no "
        "gradient and leaves the denominator; the correction's weight still applies to the kept ones. With "
        "ratio = `sequence` (GSPO) only `sequence` or `geometric`.",
    )
    is_mask_low: float = Field(
        0.5, description="Lower bound of the band of rho that is_mask keeps (1/c for a symmetric band).", gt=0, lt=1
    )
    is_mask_high: float = Field(2.0, description="Upper bound of the band of rho that is_mask keeps (c).", gt=1)
    policy_loss: Literal["ppo", "cispo", "sapo"] = Field(
        "ppo",
        description="The policy surrogate. `ppo`: the clipped ratio (clip_low, clip_high, dual_clip). `cispo` "
        "(MiniMax-M1): the ratio clipped to [1 - clip_low, 1 + clip_high] as a detached weight on log pi, so every "
        "token keeps a gradient (MiniMax tunes only the upper bound: clip_low = 1 removes the lower one). `sapo` "
        "(Qwen's SAPO): a soft sigmoid gate instead of a hard clip, with temperatures sapo_tau_pos / sapo_tau_neg "
        "for positive / negative advantages. `cispo` and `sapo` need ratio = `token` and no dual_clip.",
    )
    sapo_tau_pos: float = Field(1.0, description="SAPO's gate temperature where the advantage is > 0.", gt=0)
    sapo_tau_neg: float = Field(
        1.05, description="SAPO's gate temperature where the advantage is <= 0 (> tau_pos: decays faster).", gt=0
    )
    clip_low: float = Field(0.2, description="Ratio lower clip: 1 - clip_low (1 = no lower bound).", ge=0, le=1)
    clip_high: float = Field(0.28, description="PPO ratio upper clip: 1 + clip_high.", ge=0)
    dual_clip: float | None = Field(None, description="Dual-clip constant c > 1 for negative advantages.", gt=1)
    aggregation: Literal["token_mean", "seq_mean"] = Field("token_mean", description="Loss aggregation.")
    ratio: Literal["token", "sequence"] = Field(
        "token",
        description="PPO importance ratio pi_theta / pi_prox: per token, or `sequence` = GSPO's (Zheng et al. 2025) "
        "length-normalised ratio exp(mean of the per-token log-ratios), clipped per sequence. `sequence` needs "
        "aggregation = `seq_mean` and one weight per sequence (correction = `none`, or `tis` with tis_level = "
        "`sequence`). GSPO's paper clips far tighter than the token defaults (clip_low 3e-4, clip_high 4e-4): set "
        "them; the defaults are not changed for it.",
    )
    overlong: Literal["none", "mask", "penalty"] = Field(
        "none",
        description="Completions cut at the token limit (finish reason `length`). `mask`: kept in the batch and in "
        "their group's baseline, but no loss on their tokens. `penalty`: DAPO's soft overlong punishment added to "
        "the reward before advantages (every estimator): 0 up to L_max - overlong_window model tokens, then "
        "falling linearly to -overlong_penalty at L_max (generator.max_tokens; env.max_total_tokens with an "
        "environment).",
    )
    overlong_window: int = Field(
        0,
        description="DAPO's L_cache, in tokens: the penalty's final window of the budget. 0 = a quarter of the "
        "budget (at least 1 token). Must be at most the budget.",
        ge=0,
    )
    overlong_penalty: float = Field(
        1.0, description="Scale of the overlong penalty: the reward change at the full budget is -this.", ge=0
    )
    kl_coef: float = Field(0.0, description="KL penalty against the reference model (0 = no reference).", ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")
    kl_in_reward: bool = Field(
        False,
        description="Put the KL into the per-token reward instead of the loss (estimator `reinforce_pp`, "
        "`reinforce_pp_baseline` or `gae` only).",
    )
    entropy_coef: float = Field(0.0, description="Entropy bonus coefficient.", ge=0)
    teacher_model: str = Field(
        "",
        description="On-policy distillation (off when empty): a teacher model directory (or `smollm2`, "
        "`tiny:<family>`, as model.path) with the policy's tokenizer. The learner scores every sampled token under "
        "it and adds distill_coef * (log pi_teacher - log pi_prox) to the token's advantage: the per-token reverse "
        "KL to the teacher (learners.distillation). Costs a frozen copy of the teacher on every learner rank and "
        "one no-grad forward of it and of the policy per batch.",
    )
    distill_coef: float = Field(
        1.0, description="Weight of the teacher term in the advantage (with teacher_model).", gt=0
    )
    distill_alone: bool = Field(
        False,
        description="Train on the teacher term alone: the task advantages are left out (rewards are still "
        "computed and logged). Needs teacher_model.",
    )
    gamma: float = Field(1.0, description="Discount (gae).", ge=0, le=1)
    lam: float = Field(0.95, description="GAE lambda.", ge=0, le=1)
    value_clip: float = Field(0.2, description="Critic value clip (gae).", ge=0)
    ppo_epochs: int = Field(
        1,
        description="Passes over each drawn batch: ppo_epochs x learner.mini_batches optimizer steps per batch, "
        "against proximal log-probs taken once before the first (so the PPO clip acts from the second step on). "
        "The policy version advances, and weights publish, once per batch.",
        ge=1,
        le=64,
    )

    @model_validator(mode="after")
    def _rules_the_learner_enforces(self) -> AlgoConfig:
        """Combinations the learner cannot train with fail here, at load, not at its first step."""
        if self.estimator in GROUP_ESTIMATORS and self.group_size < 2:
            raise ValueError(f"group_size: must be >= 2 for estimator '{self.estimator}' (got {self.group_size})")
        if self.correction == "decoupled" and self.tis_level == "sequence":
            raise ValueError(
                "tis_level: 'sequence' needs correction = 'tis' (decoupled PPO weights each token); "
                "set algo.tis_level = 'token' or algo.correction = 'tis'"
            )
        if self.ratio == "sequence" and self.correction != "none" and self.tis_level != "sequence":
            raise ValueError(
                "ratio: 'sequence' (GSPO) takes one importance weight per sequence; set algo.correction = 'tis' "
                "with algo.tis_level = 'sequence', or algo.correction = 'none'"
            )
        if self.ratio == "sequence" and self.is_mask == "token":
            raise ValueError(
                "is_mask: 'token' drops tokens from inside GSPO's sequence ratio (ratio = 'sequence'); set "
                "algo.is_mask = 'sequence' or 'geometric', or algo.ratio = 'token'"
            )
        if self.ratio == "sequence" and self.aggregation != "seq_mean":
            raise ValueError(
                "ratio: 'sequence' (GSPO) averages each sequence's loss; set algo.aggregation = 'seq_mean'"
            )
        if self.policy_loss != "ppo" and (self.ratio != "token" or self.dual_clip is not None):
            raise ValueError(
                f"policy_loss: '{self.policy_loss}' is a token-level loss with its own bound; set algo.ratio = "
                "'token' and leave algo.dual_clip unset, or algo.policy_loss = 'ppo'"
            )
        if self.distill_alone and not self.teacher_model:
            raise ValueError("distill_alone: trains on the teacher's term alone; set algo.teacher_model too")
        if self.kl_in_reward and self.estimator not in KL_IN_REWARD_ESTIMATORS:
            raise ValueError(
                f"kl_in_reward: only with estimator in {KL_IN_REWARD_ESTIMATORS} (got '{self.estimator}'); "
                "set algo.kl_in_reward = false to put the KL in the loss"
            )
        return self
