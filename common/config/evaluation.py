"""`[eval]`: evaluation during training and `tandem eval`."""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    AfterValidator,
    Field,
    model_validator,
)

from common.config.base import MAX_TIMEOUT_S, REWARD_FN_PATTERN, _check_reward_fn_name, _Section

MAX_EVAL_SAMPLES = 64  # completions per prompt in one eval lease at eval.temperature (common.eval_messages.EvalGrant)
MAX_EVAL_PROMPTS = 1000  # prompts per eval set: one set is one eval lease, answered by one EvalResult message


def _check_eval_set(name: str) -> str:
    from common.eval_sets import check_set_name  # no torch, no tokenizer: checks a name (its path: config_checks)

    check_set_name(name, paths=False)
    return name


class EvalConfig(_Section):
    """Evaluation during training (`tandem run`): held-out and transfer sets sampled by the generators with the
    current policy every `every` versions, outside training (eval leases are not admitted, not staleness-bounded
    and never buffered; see buffers.evaluation). The learner never waits for it. Rows `eval/<set>/<metric>` go to
    `<run_dir>/eval.jsonl` and TensorBoard (`tb/eval`), keyed by the policy version that produced them. Off while
    `sets` is empty."""

    sets: list[Annotated[str, AfterValidator(_check_eval_set)]] = Field(
        [],
        description="Eval sets (common.eval_sets): `arithmetic` (held-out level 1), `arithmetic-d2` (held-out level "
        "2), `arithmetic-reworded` (level 1, another instruction), `word_problems` (held-out GSM8K-shaped word "
        "problems, common.word_problems) or `file:PATH` (a .jsonl/.parquet/datasets folder "
        "of prompts, scored by eval.reward_fn). Empty = no evaluation.",
    )
    every: int = Field(
        10, description="Evaluate every N policy versions (versions 0, N, 2N, ... as the learner reaches them).", ge=1
    )
    at_end: bool = Field(
        True,
        description="Also evaluate the final version: the buffer tells the generators the run is over only after "
        "it, and the learner keeps its weights published for it (at most eval.final_timeout_s).",
    )
    final_timeout_s: float = Field(
        600.0, description="How long the end of a run waits for its final evaluation.", gt=0, le=MAX_TIMEOUT_S
    )
    greedy: bool = Field(True, description="One greedy completion per prompt (rows `eval/<set>/greedy/<metric>`).")
    samples: int = Field(
        4,
        description="Completions per prompt at eval.temperature (rows `eval/<set>/<metric>`: pass@1, and pass@k "
        "with k = samples, by the unbiased estimator); 0 = greedy only.",
        ge=0,
        le=MAX_EVAL_SAMPLES,
    )
    temperature: float = Field(1.0, description="Sampling temperature of the eval samples.", gt=0, le=10)
    max_tokens: int = Field(
        0, description="Token limit of an eval completion; 0 = generator.max_tokens.", ge=0, le=131072
    )
    max_prompts: int = Field(
        50, description="Prompts per set, at most (the first ones of the set).", ge=1, le=MAX_EVAL_PROMPTS
    )
    reward_fn: Annotated[str, AfterValidator(_check_reward_fn_name)] = Field(
        "",
        description="Reward function of the eval sets (`module:function` or a built-in name, as env.reward_fn, "
        "called with its defaults); empty = env.reward_fn, with env.reward_fn_args.",
        pattern=REWARD_FN_PATTERN,
    )

    @property
    def enabled(self) -> bool:
        return bool(self.sets)

    @model_validator(mode="after")
    def _something_to_sample(self) -> EvalConfig:
        if self.sets and not self.greedy and not self.samples:
            raise ValueError("samples: 0 with greedy = false samples nothing: set eval.samples >= 1 or greedy = true")
        from common.eval_sets import set_label

        labels = [set_label(name) for name in self.sets]
        if len(set(labels)) != len(labels):
            raise ValueError(
                f"sets: {self.sets} gives two sets one metrics name ({labels}: eval/<name>/...); rename a file"
            )
        return self
