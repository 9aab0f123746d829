"""Evaluation metrics of completions: pass@k, strict and lenient accuracy, reward, length, truncation.

    from common.eval_metrics import Completion, score_completion, set_metrics
    scored = [[score_completion(c, record.metadata, reward_fn) for c in completions] for ...]   # per prompt
    metrics = set_metrics(scored)     # {"strict_accuracy": ..., "pass@1": ..., "pass@k": ..., "k": 4, ...}
    row = result_metrics(eval_result, greedy=True, samples=4)   # {"greedy/strict_accuracy": ..., "pass@k": ...}

Pure functions, no engine and no torch: `tandem eval` (launch/evaluate.py) computes its table with them, and
evaluation during training (issue 16: `result_metrics` of an EvalResult, in buffers.evaluation) aggregates with
the same code, so both report the same metrics under the same keys (`eval/<set>/<key>` there).

What counts as right (arithmetic, or any set whose prompts carry `metadata["answer"]`):
  strict   the answer after the last `####` marker is the expected one (what the prompt asks the model to write)
  lenient  strict, or the last number anywhere in the completion is the expected one (marker or not)
A model that answers right without the marker is lenient-right and strict-wrong: the two tell format learning and
answer learning apart. A sample passes (pass@k) when it is strictly right; in a set without answers it passes when
its reward function returns a `correct` component > 0, and pass@k is undefined (None) when it returns none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.tasks import ANSWER_MARKER, parse_answer, total_reward

# The keys of `set_metrics`, in table order (reward components, `reward/<name>`, come after `mean_reward`).
METRIC_KEYS = (
    "strict_accuracy",
    "lenient_accuracy",
    "strict_accuracy_stderr",
    "pass@1",
    "pass@k",
    "k",
    "mean_reward",
    "mean_tokens",
    "truncated_share",
    "prompts",
    "samples",
)
TRUNCATED = "length"  # the finish reason of a completion cut at the token limit


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"):
    the chance that at least one of k completions drawn without replacement from n, of which c are right, is right,
    `1 - C(n - c, k) / C(n, k)`.

    Computed as `1 - prod_{i = n-c+1}^{n} (1 - k / i)`, a product of c factors in [0, 1): no huge binomials, no
    cancellation (the form of the paper's numpy code). Exactly 1.0 when n - c < k (every draw of k holds a right
    one) and 0.0 when c = 0.
    Raises ValueError unless 0 <= c <= n and 1 <= k <= n (k > n completions cannot be drawn from n), TypeError
    for a non-integer count.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"pass_at_k: {name} must be an int, got {type(value).__name__} {value!r}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got c = {c}, n = {n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n (k completions drawn from n), got k = {k}, n = {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass(frozen=True)
class Completion:
    """One sampled completion: its text (special tokens skipped), its token count, and why it ended ("stop" at the
    end of sequence, "length" at the token limit)."""

    text: str
    num_tokens: int
    finish_reason: str


@dataclass(frozen=True)
class ScoredCompletion:
    """A completion with its verdicts. strict/lenient are None where the prompt has no `answer`; passed is None
    where neither an answer nor a `correct` reward component says whether it is right; rm_score is set later,
    by the reward model, when there is one."""

    completion: Completion
    reward: float
    components: dict[str, float]
    strict: bool | None
    lenient: bool | None
    passed: bool | None
    rm_score: float | None = field(default=None)


def expected_answer(metadata: Mapping[str, Any]) -> float | None:
    """The number `metadata["answer"]` holds (an int, a float or a numeric string such as "1,234"), or None when
    there is no answer. Raises ValueError for an answer with no number in it."""
    if "answer" not in metadata:
        return None
    value = metadata["answer"]
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"metadata['answer'] = {value!r}: expected a number or a numeric string")
    number, _ = parse_answer(str(value))
    if number is None:
        raise ValueError(f"metadata['answer'] = {value!r} is not a number")
    return number


def _same(a: float | None, b: float) -> bool:
    return a is not None and math.isclose(a, b, rel_tol=0.0, abs_tol=1e-9)


def answer_verdicts(text: str, expected: float) -> tuple[bool, bool]:
    """(strict, lenient) for a completion whose right answer is `expected` (see the module docstring)."""
    after_marker, formatted = parse_answer(text)
    strict = formatted and _same(after_marker, expected)
    last_number, _ = parse_answer(text.replace(ANSWER_MARKER, " "))  # no marker: the last number in the text
    return strict, strict or _same(last_number, expected)


def score_completion(
    completion: Completion, metadata: Mapping[str, Any], reward_fn: Callable[[str, Mapping[str, Any]], Any]
) -> ScoredCompletion:
    """`completion` judged against its prompt's `metadata` and scored by `reward_fn(text, metadata)` (a float or a
    mapping of named components, as `common.tasks.total_reward` reads it). A reward function that raises, or
    returns something `total_reward` refuses, raises: an evaluation has no fallback reward to hide it behind."""
    reward, components = total_reward(reward_fn(completion.text, metadata))
    expected = expected_answer(metadata)
    if expected is None:
        strict = lenient = None
        passed = components["correct"] > 0 if "correct" in components else None
    else:
        strict, lenient = answer_verdicts(completion.text, expected)
        passed = strict
    return ScoredCompletion(completion, reward, components, strict, lenient, passed)


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def _share(flags: list[bool | None]) -> float | None:
    """The share of True among `flags`; None when any is None (the verdict is not defined for this set)."""
    if any(flag is None for flag in flags):
        return None
    return _mean([1.0 if flag else 0.0 for flag in flags])


def _prompt_stderr(shares: list[float | None]) -> float | None:
    """The standard error of the mean of per-prompt shares (sample variance, n - 1); None when a share is
    undefined or there is only one prompt."""
    if len(shares) < 2 or any(share is None for share in shares):
        return None
    mean = _mean(shares)  # type: ignore[arg-type]
    variance = math.fsum((share - mean) ** 2 for share in shares) / (len(shares) - 1)  # type: ignore[operator]
    return math.sqrt(variance / len(shares))


def _pass_rates(groups: Sequence[Sequence[ScoredCompletion]], k: int) -> tuple[float | None, float | None]:
    """(pass@1, pass@k), each the mean over prompts of the unbiased estimator; None when a verdict is missing."""
    if any(s.passed is None for group in groups for s in group):
        return None, None
    counts = [(len(group), sum(1 for s in group if s.passed)) for group in groups]
    return _mean([pass_at_k(n, c, 1) for n, c in counts]), _mean([pass_at_k(n, c, k) for n, c in counts])


def set_metrics(groups: Sequence[Sequence[ScoredCompletion]], k: int | None = None) -> dict[str, Any]:
    """The metrics of one evaluation set: `groups[p]` holds the scored completions of prompt p, the same number n
    for every prompt; pass@k is taken with `k` (default n; 1 <= k <= n).

    Keys: strict_accuracy, lenient_accuracy (shares of all completions; None without answers),
    strict_accuracy_stderr (the standard error of strict_accuracy with prompts as the units: the sample standard
    deviation of the prompts' own strict shares over sqrt(prompts), since a prompt's completions are not
    independent of each other; None without answers or with one prompt), pass@1, pass@k (the
    unbiased estimator averaged over prompts; None where no verdict exists), k, mean_reward and `reward/<name>` for
    every component (a component absent from a completion counts as 0 there), mean_tokens, truncated_share (the
    share that stopped at the token limit), rm_score (the mean reward-model score; only when every completion has
    one), prompts, samples (all completions). With n = 1 (greedy), pass@1 = pass@k = strict_accuracy.
    Raises ValueError for no prompts, an empty group, or groups of different sizes.
    """
    if not groups:
        raise ValueError("set_metrics: no prompts to aggregate")
    sizes = {len(group) for group in groups}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(f"set_metrics: every prompt needs the same number (>= 1) of completions, got {sorted(sizes)}")
    n = sizes.pop()
    k = n if k is None else k
    flat = [s for group in groups for s in group]
    pass_1, pass_k = _pass_rates(groups, k)
    metrics: dict[str, Any] = {
        "strict_accuracy": _share([s.strict for s in flat]),
        "lenient_accuracy": _share([s.lenient for s in flat]),
        "strict_accuracy_stderr": _prompt_stderr([_share([s.strict for s in group]) for group in groups]),
        "pass@1": pass_1,
        "pass@k": pass_k,
        "k": k,
        "mean_reward": _mean([s.reward for s in flat]),
    }
    for name in sorted({name for s in flat for name in s.components}):
        metrics[f"reward/{name}"] = _mean([s.components.get(name, 0.0) for s in flat])
    metrics["mean_tokens"] = _mean([float(s.completion.num_tokens) for s in flat])
    metrics["truncated_share"] = _mean([1.0 if s.completion.finish_reason == TRUNCATED else 0.0 for s in flat])
    if all(s.rm_score is not None for s in flat):
        metrics["rm_score"] = _mean([s.rm_score for s in flat])  # type: ignore[misc]
    metrics["prompts"] = len(groups)
    metrics["samples"] = len(flat)
    return metrics


def _verdict(value: int) -> bool | None:
    """An EvalResult verdict (`common.eval_messages.VERDICTS`: -1 not defined, 0 wrong, 1 right) as score_completion's."""
    return None if value < 0 else bool(value)


def result_metrics(result: Any, greedy: bool, samples: int) -> dict[str, Any]:
    """The metrics of one `common.eval_messages.EvalResult` (evaluation during training): the same `set_metrics` as
    `tandem eval`, over completions rebuilt from the result's columns. Completion p * m + j belongs to prompt p
    (m = greedy + samples, the greedy one first), as the result's docstring lays them out.

    Keys: `greedy/<metric>` for the greedy completions (k = 1) when `greedy`, and `<metric>` for the `samples`
    completions at temperature (pass@k with k = samples) when samples >= 1 (see `set_metrics` for each metric).
    The texts are not sent, so a rebuilt completion has none: every metric is computed from the verdicts, the
    rewards, the token counts and the truncation flags. Raises ValueError when the result does not hold
    len(prompt_ids) x m completions, or when both modes are off."""
    m = int(greedy) + samples
    prompts = len(result.prompt_ids)
    total = len(result.rewards)
    if m < 1 or samples < 0:
        raise ValueError(f"result_metrics: greedy {greedy} and samples {samples} sample nothing")
    if total != prompts * m:
        raise ValueError(f"result_metrics: {total} completions, expected {prompts} prompts x {m} = {prompts * m}")
    components = {name: values.tolist() for name, values in result.reward_components.items()}
    rewards, tokens = result.rewards.tolist(), result.num_tokens.tolist()
    truncated, strict = result.truncated.tolist(), result.strict.tolist()
    lenient, passed = result.lenient.tolist(), result.passed.tolist()
    scored = [
        ScoredCompletion(
            Completion("", int(tokens[i]), TRUNCATED if truncated[i] else "stop"),
            float(rewards[i]),
            {name: float(values[i]) for name, values in components.items()},
            _verdict(strict[i]),
            _verdict(lenient[i]),
            _verdict(passed[i]),
        )
        for i in range(total)
    ]
    groups = [scored[p * m : (p + 1) * m] for p in range(prompts)]
    metrics: dict[str, Any] = {}
    if greedy:
        metrics.update({f"greedy/{key}": value for key, value in set_metrics([g[:1] for g in groups]).items()})
    if samples:
        metrics.update(set_metrics([g[int(greedy) :] for g in groups]))
    return metrics
