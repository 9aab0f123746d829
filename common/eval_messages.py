"""The messages of evaluation during training (buffers.evaluation, actors.evaluation), declared as every wire
message is (`common.types`: `message`, field bounds, `validate`) and registered by importing this module
(`common.wire` does).

An eval lease is one eval set, sampled by one generator with one policy version and answered by one EvalResult.
Not a training lease: outside admission, the staleness bound and the replay buffer, with its own numbering and its
own line in the buffer's accounting.
"""

from __future__ import annotations

from dataclasses import field

import numpy as np

from common.types import (
    MAX_NAME_CHARS,
    MAX_REWARD_COMPONENTS,
    ContractError,
    PromptItem,
    array,
    count,
    message,
    version,
)

MAX_EVAL_COMPLETIONS = 1 << 16  # completions in one EvalResult (eval.max_prompts x (greedy + eval.samples) is below)
VERDICTS = (-1, 0, 1)  # strict / lenient / passed per completion: -1 = not defined for this set, 0 = wrong, 1 = right


@message("eval_grant")
class EvalGrant:
    """Buffer -> generator, the reply to a LeaseRequest while an evaluation is due (ahead of training prompts):
    sample every prompt of eval set `set_name` with weights of version >= `min_version`, all with one version (no
    weights load in between: hold it, or redo the samples), and send one EvalResult before `deadline` (unix time).
    Per prompt: one greedy completion first if `greedy`, then `samples` at `temperature`, each of at most
    `max_tokens` tokens."""

    lease_id: int = count()  # eval leases have their own numbering (not a training lease id)
    deadline: float
    set_name: str
    min_version: int = version()  # the version the evaluation round is for
    greedy: bool
    samples: int = count()
    temperature: float
    max_tokens: int = count(1)
    prompts: list[PromptItem]

    @property
    def per_prompt(self) -> int:
        """Completions per prompt: the greedy one (if any) and the samples."""
        return int(self.greedy) + self.samples


@message("eval_result")
class EvalResult:
    """Generator -> buffer: the scored completions of eval lease `lease_id`, all made by weights `policy_version`.

    Columnar, prompt-major: prompt `prompt_ids[p]` owns completions [p * m, (p + 1) * m) with m =
    `EvalGrant.per_prompt` (the greedy one first). Per completion: the scalar reward and its components, the
    completion's token count, whether it stopped at the token limit, and the verdicts of
    `common.eval_metrics.score_completion` (VERDICTS: -1 where not defined)."""

    generator_id: int = count()
    lease_id: int = count()
    policy_version: int = version()
    prompt_ids: list[int] = count()  # [P], the lease's prompts in its order
    rewards: np.ndarray = array("float32")  # [P * m]
    num_tokens: np.ndarray = array("int32")  # [P * m]
    truncated: np.ndarray = array("uint8")  # [P * m]: 1 = stopped at max_tokens
    strict: np.ndarray = array("int8")  # [P * m]: the answer after the marker is right
    lenient: np.ndarray = array("int8")  # [P * m]: strict, or the last number is right
    passed: np.ndarray = array("int8")  # [P * m]: counts toward pass@k
    reward_components: dict[str, np.ndarray] = field(default_factory=dict)  # name -> float32 [P * m]
    started_at: float = 0.0  # unix time the first eval request went to the engine
    finished_at: float = 0.0  # unix time the last one finished

    def validate(self) -> None:
        """Alignment and value ranges (the lease's layout, P x m, is the buffer's check)."""
        total = len(self.rewards)
        if not self.prompt_ids or total == 0 or total % len(self.prompt_ids):
            raise ContractError(
                f"eval_result: {total} completions for {len(self.prompt_ids)} prompts (need a multiple, >= 1 each)"
            )
        if total > MAX_EVAL_COMPLETIONS:
            raise ContractError(f"eval_result: {total} completions (at most {MAX_EVAL_COMPLETIONS})")
        if len(set(self.prompt_ids)) != len(self.prompt_ids):
            raise ContractError("eval_result.prompt_ids: a prompt appears twice")
        for name in ("num_tokens", "truncated", "strict", "lenient", "passed"):
            if len(getattr(self, name)) != total:
                raise ContractError(f"eval_result.{name}: length {len(getattr(self, name))} != {total} completions")
        if len(self.reward_components) > MAX_REWARD_COMPONENTS:
            raise ContractError(f"eval_result.reward_components: more than {MAX_REWARD_COMPONENTS}")
        for name, values in self.reward_components.items():
            if len(name) > MAX_NAME_CHARS:
                raise ContractError(f"eval_result.reward_components: a name longer than {MAX_NAME_CHARS} characters")
            if values.dtype != np.float32 or values.shape != (total,) or not np.all(np.isfinite(values)):
                raise ContractError(f"eval_result.reward_components.{name}: must be finite float32 [{total}]")
        if not np.all(np.isfinite(self.rewards)):
            raise ContractError("eval_result.rewards: must be finite")
        if np.any(self.num_tokens < 0) or np.any(self.truncated > 1):
            raise ContractError("eval_result: num_tokens must be >= 0 and truncated 0 or 1")
        for name in ("strict", "lenient", "passed"):
            if np.any((getattr(self, name) < -1) | (getattr(self, name) > 1)):
                raise ContractError(f"eval_result.{name}: values must be -1, 0 or 1")


@message("eval_ack")
class EvalAck:
    """Buffer -> generator: status 'accepted', 'duplicate' (that eval lease was answered already: fine) or
    'rejected' (+ reason: the set is sampled again, by whichever generator asks next)."""

    lease_id: int = count()
    status: str
    reason: str = ""
