"""`common.eval_metrics.result_metrics`: the metrics of an EvalResult (evaluation during training) against
hand-worked values for 2 prompts x (1 greedy + 3 samples), the greedy and the sampled completions apart; verdicts
of -1 (not defined for the set) give no accuracy and no pass@k; a result of the wrong layout is refused."""

from __future__ import annotations

import numpy as np
import pytest

from common.eval_messages import EvalResult
from common.eval_metrics import result_metrics

# Per completion, prompt-major, greedy first: (strict, lenient, passed, reward, tokens, truncated, format component)
ROWS = [
    (1, 1, 1, 1.0, 10, 0, 0.5),  # prompt 0, greedy
    (1, 1, 1, 1.0, 12, 0, 0.5),  # prompt 0, samples
    (0, 1, 0, 0.5, 20, 0, 0.25),
    (0, 0, 0, 0.0, 30, 1, 0.0),
    (0, 1, 0, 0.5, 8, 0, 0.25),  # prompt 1, greedy
    (0, 0, 0, 0.0, 16, 1, 0.0),  # prompt 1, samples
    (0, 1, 0, 0.5, 32, 1, 0.25),
    (0, 0, 0, 0.0, 4, 0, 0.0),
]


def eval_result(rows: list[tuple], prompt_ids: list[int]) -> EvalResult:
    columns = list(zip(*rows))
    return EvalResult(
        generator_id=0,
        lease_id=1,
        policy_version=3,
        prompt_ids=prompt_ids,
        rewards=np.array(columns[3], np.float32),
        num_tokens=np.array(columns[4], np.int32),
        truncated=np.array(columns[5], np.uint8),
        strict=np.array(columns[0], np.int8),
        lenient=np.array(columns[1], np.int8),
        passed=np.array(columns[2], np.int8),
        reward_components={"correct": np.array(columns[2], np.float32), "format": np.array(columns[6], np.float32)},
    )


def test_greedy_and_samples_match_hand_worked_values() -> None:
    result = eval_result(ROWS, [7, 9])
    result.validate()
    metrics = result_metrics(result, greedy=True, samples=3)
    # greedy: prompt 0 right, prompt 1 lenient-only. samples: prompt 0 has 1 of 3 strictly right, prompt 1 none.
    # pass@1 = mean(1/3, 0/3); pass@3 from 3 samples = 1 - C(n-c, 3)/C(3, 3): 1 for c = 1, 0 for c = 0.
    expected = {
        "greedy/strict_accuracy": 1 / 2,
        "greedy/lenient_accuracy": 2 / 2,
        # prompts' strict shares 1 and 0: sample variance ((1/2)^2 + (1/2)^2) / 1 = 1/2, over 2 prompts -> sqrt(1/4)
        "greedy/strict_accuracy_stderr": 1 / 2,
        "greedy/pass@1": 1 / 2,
        "greedy/pass@k": 1 / 2,
        "greedy/k": 1,
        "greedy/mean_reward": (1.0 + 0.5) / 2,
        "greedy/reward/correct": 1 / 2,
        "greedy/reward/format": (0.5 + 0.25) / 2,
        "greedy/mean_tokens": (10 + 8) / 2,
        "greedy/truncated_share": 0.0,
        "greedy/prompts": 2,
        "greedy/samples": 2,
        "strict_accuracy": 1 / 6,
        "lenient_accuracy": 3 / 6,
        # prompts' strict shares 1/3 and 0 (mean 1/6): variance 2 (1/6)^2 / 1 = 1/18, over 2 prompts -> sqrt(1/36)
        "strict_accuracy_stderr": 1 / 6,
        "pass@1": (1 / 3 + 0) / 2,
        "pass@k": (1.0 + 0.0) / 2,
        "k": 3,
        "mean_reward": (1.0 + 0.5 + 0.0 + 0.0 + 0.5 + 0.0) / 6,
        "reward/correct": 1 / 6,
        "reward/format": (0.5 + 0.25 + 0.25) / 6,
        "mean_tokens": (12 + 20 + 30 + 16 + 32 + 4) / 6,
        "truncated_share": 3 / 6,
        "prompts": 2,
        "samples": 6,
    }
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        # every input is a dyadic fraction (exact in float32 and float64); only a division by 2, 3 or 6 rounds,
        # and the estimator's product of 1 - 1/i factors: a few ulps of 1.0
        assert metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key


def test_samples_only_and_greedy_only() -> None:
    samples_only = [row for i, row in enumerate(ROWS) if i % 4]  # drop each prompt's greedy completion
    metrics = result_metrics(eval_result(samples_only, [7, 9]), greedy=False, samples=3)
    assert not any(key.startswith("greedy/") for key in metrics) and metrics["k"] == 3
    assert metrics["strict_accuracy"] == pytest.approx(1 / 6, rel=1e-12)  # one division by 6 rounds
    greedy_only = [row for i, row in enumerate(ROWS) if i % 4 == 0]
    metrics = result_metrics(eval_result(greedy_only, [7, 9]), greedy=True, samples=0)
    assert set(metrics) == {key for key in metrics if key.startswith("greedy/")}
    assert metrics["greedy/strict_accuracy"] == 0.5 and metrics["greedy/pass@k"] == 0.5


def test_undefined_verdicts_give_no_accuracy_and_no_pass_at_k() -> None:
    rows = [(-1, -1, -1, *row[3:]) for row in ROWS]  # a set without answers and no `correct` component
    result = eval_result(rows, [7, 9])
    metrics = result_metrics(result, greedy=True, samples=3)
    for key in ("strict_accuracy", "lenient_accuracy", "strict_accuracy_stderr", "pass@1", "pass@k"):
        assert metrics[key] is None and metrics[f"greedy/{key}"] is None, key
    assert metrics["mean_tokens"] == pytest.approx(19.0, rel=1e-12)  # 114 / 6


def test_a_result_of_the_wrong_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="2 prompts x 3"):
        result_metrics(eval_result(ROWS, [7, 9]), greedy=True, samples=2)
