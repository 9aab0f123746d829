"""pass@k against hand-worked values, the strict/lenient verdicts, and the aggregation of fixed completions."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.eval_metrics import Completion, answer_verdicts, pass_at_k, score_completion, set_metrics
from common.tasks import arithmetic_reward


# n = 5 completions, c = 2 right: 1 - C(3, k) / C(5, k) with C(5, k) = 5, 10, 10, 5, 1 and C(3, k) = 3, 3, 1, 0, 0.
@pytest.mark.parametrize(("k", "expected"), [(1, 1 - 3 / 5), (2, 1 - 3 / 10), (3, 1 - 1 / 10), (4, 1.0), (5, 1.0)])
def test_pass_at_k_n5_c2(k: int, expected: float) -> None:
    assert pass_at_k(5, 2, k) == pytest.approx(expected, abs=1e-12)  # a product of <= 2 factors: exact to ~1e-16


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (10, 3, 1, 0.3),  # pass@1 = c / n
        (10, 3, 2, 1 - 21 / 45),  # C(7, 2) = 21, C(10, 2) = 45
        (10, 3, 5, 1 - 21 / 252),  # C(7, 5) = 21, C(10, 5) = 252
        (4, 0, 4, 0.0),  # nothing right: never passes
        (4, 4, 1, 1.0),  # everything right
        (1, 1, 1, 1.0),  # greedy, right
        (1, 0, 1, 0.0),  # greedy, wrong
        (8, 1, 8, 1.0),  # k = n: passes iff c > 0
    ],
)
def test_pass_at_k_hand_worked(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_stable_where_binomials_are_huge() -> None:
    # C(2000, 1000) ~ 1e600 overflows a float; the product form stays exact: n = 2000, c = 1, k = 1000 -> k / n = 0.5
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5, abs=1e-12)
    assert pass_at_k(2000, 2, 1) == pytest.approx(0.001, abs=1e-15)


@given(st.integers(1, 60).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_equals_the_binomial_form(nck: tuple[int, int, int]) -> None:
    n, c, k = nck
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # small n: Python's exact integers, one rounding at the end
    assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)  # <= 60 factors, each rounded once: ~1e-14


@given(st.integers(2, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
def test_pass_at_k_grows_with_k(nc: tuple[int, int]) -> None:
    n, c = nc
    values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
    assert all(a <= b + 1e-15 for a, b in itertools.pairwise(values))


@pytest.mark.parametrize(("n", "c", "k"), [(5, 2, 6), (5, 2, 0), (5, 6, 1), (5, -1, 1), (0, 0, 1)])
def test_pass_at_k_refuses_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_pass_at_k_refuses_non_integers() -> None:
    with pytest.raises(TypeError, match="k must be an int"):
        pass_at_k(5, 2, 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "strict", "lenient"),
    [
        ("3 + 4 = 7\n#### 7", True, True),
        ("#### 3 + 4 = 7.", True, True),  # the last number on the marker's line, as the verifier reads it
        ("#### 7\nsince 3 + 4", True, True),  # lenient includes strict, whatever number comes last
        ("The answer is 7.", False, True),  # right, no marker: format not learned, answer learned
        ("#### 8\nso 7", False, True),  # the marker's answer is wrong, the last number right
        ("7 or 8", False, False),
        ("####", False, False),
        ("", False, False),
    ],
)
def test_strict_and_lenient_verdicts(text: str, strict: bool, lenient: bool) -> None:
    assert answer_verdicts(text, 7.0) == (strict, lenient)


def _c(text: str, tokens: int = 5, finish: str = "stop") -> Completion:
    return Completion(text, tokens, finish)


def test_set_metrics_of_fixed_completions() -> None:
    meta_7, meta_3 = {"answer": 7}, {"answer": "3"}
    groups = [
        [
            score_completion(_c("#### 7", 4), meta_7, arithmetic_reward),  # strict: correct 1 + format 0.1
            score_completion(_c("it is 7", 6), meta_7, arithmetic_reward),  # lenient only: correct 1
            score_completion(_c("#### 8", 8, "length"), meta_7, arithmetic_reward),  # wrong, formatted: 0.1
        ],
        [
            score_completion(_c("no idea", 10, "length"), meta_3, arithmetic_reward),  # 0
            score_completion(_c("#### 3", 2), meta_3, arithmetic_reward),  # strict: 1.1
            score_completion(_c("2", 6), meta_3, arithmetic_reward),  # 0
        ],
    ]
    m = set_metrics(groups)
    assert m["strict_accuracy"] == pytest.approx(2 / 6)
    assert m["lenient_accuracy"] == pytest.approx(3 / 6)
    assert m["k"] == 3 and m["prompts"] == 2 and m["samples"] == 6
    assert m["pass@1"] == pytest.approx((1 / 3 + 1 / 3) / 2)  # each prompt one strict-right of three
    assert m["pass@k"] == pytest.approx(1.0)  # k = n = 3, c = 1: every prompt passes
    assert m["reward/correct"] == pytest.approx(3 / 6)
    assert m["reward/format"] == pytest.approx(3 * 0.1 / 6)
    assert m["mean_reward"] == pytest.approx((1.1 + 1.0 + 0.1 + 0 + 1.1 + 0) / 6)
    assert m["mean_tokens"] == pytest.approx((4 + 6 + 8 + 10 + 2 + 6) / 6)
    assert m["truncated_share"] == pytest.approx(2 / 6)
    assert "rm_score" not in m
    assert set_metrics(groups, k=2)["pass@k"] == pytest.approx((pass_at_k(3, 1, 2) + pass_at_k(3, 1, 2)) / 2)


def test_greedy_pass_rates_equal_strict_accuracy() -> None:
    groups = [[score_completion(_c(text), {"answer": 5}, arithmetic_reward)] for text in ("#### 5", "5", "#### 4")]
    m = set_metrics(groups)
    assert m["pass@1"] == m["pass@k"] == m["strict_accuracy"] == pytest.approx(1 / 3)
    assert m["lenient_accuracy"] == pytest.approx(2 / 3)


def test_sets_without_answers_pass_by_the_correct_component_or_not_at_all() -> None:
    def graded(text: str, metadata: dict) -> dict[str, float]:
        return {"correct": float("yes" in text), "style": 0.5}

    groups = [[score_completion(_c("yes"), {}, graded), score_completion(_c("no"), {}, graded)]]
    m = set_metrics(groups)
    assert m["strict_accuracy"] is None and m["lenient_accuracy"] is None
    assert m["pass@1"] == pytest.approx(0.5) and m["pass@k"] == pytest.approx(1.0)
    plain = set_metrics([[score_completion(_c("x"), {}, lambda text, metadata: 0.25)]])
    assert plain["pass@1"] is None and plain["pass@k"] is None
    assert plain["mean_reward"] == pytest.approx(0.25) and plain["reward/reward"] == pytest.approx(0.25)


def test_rm_scores_are_averaged_when_every_completion_has_one() -> None:
    from dataclasses import replace

    scored = [score_completion(_c("#### 1"), {"answer": 1}, arithmetic_reward) for _ in range(2)]
    groups = [[replace(scored[0], rm_score=1.5)], [replace(scored[1], rm_score=-0.5)]]
    assert set_metrics(groups)["rm_score"] == pytest.approx(0.5)


def test_set_metrics_refuses_ragged_or_empty_groups() -> None:
    one = score_completion(_c("1"), {"answer": 1}, arithmetic_reward)
    with pytest.raises(ValueError, match="no prompts"):
        set_metrics([])
    with pytest.raises(ValueError, match="same number"):
        set_metrics([[one], [one, one]])
    with pytest.raises(ValueError, match="same number"):
        set_metrics([[]])


def test_a_raising_reward_function_is_not_hidden() -> None:
    def broken(text: str, metadata: dict) -> float:
        raise KeyError("label")

    with pytest.raises(KeyError, match="label"):
        score_completion(_c("1"), {}, broken)
