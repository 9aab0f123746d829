"""The built-in math verifier (common/math_reward.py, common/math_verify_worker.py) and `env.reward_fn = "math"`.

Unmarked tests stay on the fast path (the conftest refuses a worker process in them, so a case that silently needs
sympy fails there); `integration` tests start the math-verify workers. The timing figures print with `-s`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import math_reward as mr
from common.config import EnvConfig, load_config
from common.tasks import arithmetic_reward, resolve_reward_fn

W = mr.DEFAULT_FORMAT_WEIGHT
RIGHT, RIGHT_UNFORMATTED = {"correct": 1.0, "format": W}, {"correct": 1.0, "format": 0.0}
WRONG_FORMATTED, NOTHING = {"correct": 0.0, "format": W}, {"correct": 0.0, "format": 0.0}
GSM8K = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
MATH_SOLUTION = "We have $x^2 = 1/4$, so the positive root is $x = \\boxed{\\frac{1}{2}}$."


def score(completion: str, answer: object, **args: object) -> dict[str, float]:
    return mr.math_reward(completion, {"answer": answer}, **args)


# ---------------------------------------------------------------------------------------- extraction (no workers)


@pytest.mark.parametrize(
    ("completion", "answer", "form"),
    [
        ("so \\boxed{12}.", "12", "boxed"),
        ("\\boxed{\\frac{1}{\\sqrt{2}}} is it", "\\frac{1}{\\sqrt{2}}", "boxed"),  # nested braces
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}", "boxed"),  # escaped braces are literal
        ("first \\boxed{1}, then \\boxed{2}", "2", "boxed"),  # the last box
        ("ok \\boxed{3} then \\boxed{4", "3", "boxed"),  # an unclosed last box: the last whole one
        ("$\\boxed 5$", "5", "boxed"),
        ("\\fbox{7}", "7", "boxed"),
        ("24 + 48 = 72\n#### 72\n", "72", "hash"),
        ("#### 3\nwait, no\n#### 4", "4", "hash"),
        ("So the final answer is $\\frac34$.", "$\\frac34$.", "answer_is"),
        ("work...\n**Answer:** 42", "42", "answer_is"),
        ("I get 5 and then 17 apples", "17", "last_number"),
    ],
)
def test_each_form_is_read(completion: str, answer: str, form: str) -> None:
    found, found_form = mr.extract_answer(completion)
    assert (found.strip(), found_form) == (answer, form)


def test_the_forms_and_their_order_are_configurable() -> None:
    text = "The answer is 3.\n#### 4\n\\boxed{5}"
    assert mr.extract_answer(text)[0] == "5"
    assert mr.extract_answer(text, ["hash", "boxed"])[0].strip() == "4"
    assert mr.extract_answer(text, ["answer_is"])[0].strip() == "3."
    assert mr.extract_answer("I think 9", ["boxed", "hash"]) == (None, None)  # no explicit form, no fallback


def test_malformed_and_empty_completions_have_no_answer() -> None:
    for completion in ["", "   ", "\\boxed{", "\\boxed{}", "}}}{{{", "#### \n\n", "no number here", "\\boxed"]:
        assert mr.extract_answer(completion, ["boxed", "hash", "answer_is"]) == (None, None), completion
        assert score(completion, 3) == NOTHING


def test_extraction_is_linear_in_a_hostile_50kb_completion() -> None:
    """50 KB of unclosed boxes and markers: one brace pass, no backtracking (a quadratic scan of 7,000 boxes of
    50 KB each would be ~3.5e8 steps, tens of seconds in Python; linear is ~1e5 steps, milliseconds)."""
    hostile = "\\boxed{" * 7000 + "the answer is " * 200 + "{" * 2000
    started = time.perf_counter()
    assert mr.extract_answer(hostile, ["boxed"]) == (None, None)
    mr.extract_answer(hostile)
    assert time.perf_counter() - started < 1.0  # ~100x the linear cost measured here (~10 ms)


def test_ground_truths_of_every_shape() -> None:
    assert mr.gold_answer(72) == "72" and mr.gold_answer(7.0) == "7" and mr.gold_answer(0.5) == "0.5"
    assert mr.gold_answer(GSM8K).strip() == "72"
    assert mr.gold_answer(MATH_SOLUTION) == "\\frac{1}{2}"
    assert mr.gold_answer("\\left[1, 2\\right)") == "\\left[1, 2\\right)"  # a plain string is the answer
    for bad in ["", "  ", "#### ", "\\boxed{}", True, None, [1]]:
        with pytest.raises(ValueError, match="metadata"):
            mr.gold_answer(bad)
    with pytest.raises(KeyError, match="solution"):
        mr.math_reward("\\boxed{1}", {"answer": 1}, answer_key="solution")


# ---------------------------------------------------------------------------------------------- the fast path


@pytest.mark.parametrize(
    ("gold", "answer"),
    [
        ("0.5", "\\frac{1}{2}"),
        ("1/2", "\\frac12"),
        ("\\dfrac{1}{2}", "0.5"),
        ("1234", "1,234"),
        ("72", "$72$"),
        ("-3", "\u22123"),
        ("18", "\\$18"),
        ("3", "3.0"),
        ("[1,2)", "[1, 2)"),
        ("18", "18 dollars."),  # units text after a number
        ("5", "5\\text{ cm}"),
    ],
)
def test_equal_values_written_differently_need_no_sympy(gold: str, answer: str) -> None:
    assert mr.fast_equal(gold, answer) is True
    assert score(f"\\boxed{{{answer}}}", gold) == RIGHT


def test_different_integers_are_wrong_without_sympy_and_the_rest_is_left_to_it() -> None:
    assert mr.fast_equal("72", "71") is False and mr.fast_equal("1,234", "1235") is False
    assert mr.fast_equal("1/3", "0.333333") is None  # sympy's rounding decides, as math-verify would
    assert mr.fast_equal("\\{1,2\\}", "\\{2,1\\}") is None and mr.fast_equal("9" * 100, "9" * 100) is True
    assert mr.exact_number("9" * 100) is None  # past MAX_FAST_DIGITS: sympy's (and int() refuses 4,300 digits)
    assert score("#### 71", GSM8K) == WRONG_FORMATTED and score("#### 71 clips", GSM8K) == WRONG_FORMATTED


def test_an_answer_far_longer_than_any_gold_is_wrong_at_once() -> None:
    before = mr.stats()["too_long"]
    assert score("\\boxed{" + "x+" * 25_000 + "x}", "5") == WRONG_FORMATTED  # 50 KB: no worker asked
    assert mr.stats()["too_long"] == before + 1


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=-(10**12), max_value=10**12), st.sampled_from(["boxed", "hash", "float", "commas"]))
def test_any_integer_in_any_form_is_right(n: int, form: str) -> None:
    completion = {
        "boxed": f"so \\boxed{{{n}}}",
        "hash": f"work\n#### {n}",
        "float": f"The answer is {n}.0",
        "commas": f"Answer: {n:,}",
    }[form]
    assert score(completion, n) == RIGHT
    assert score(completion, str(n))["correct"] == 1.0 and score(completion, n + 1)["correct"] == 0.0


def test_the_fast_path_costs_microseconds() -> None:
    cases = [("so the total is \\boxed{72}.", GSM8K), ("#### 1,234", 1234), ("The answer is $\\frac12$", "0.5")]
    before = mr.stats()
    repeats = 2000
    started = time.perf_counter()
    for _ in range(repeats):
        for completion, gold in cases:
            assert score(completion, gold)["correct"] == 1.0
    per_call_us = (time.perf_counter() - started) / (repeats * len(cases)) * 1e6
    print(f"\nfast path: {per_call_us:.1f} us a call (extraction included; AMD EPYC avx2, 2 shared cores)")
    assert mr.stats()["compared"] == before["compared"]  # no call reached a worker
    assert per_call_us < 1000  # ~10-20 us measured here: 50x headroom for a loaded machine; sympy costs >= 500 us


# ------------------------------------------------------------------------------------ the config and the alias


def test_reward_fn_args_are_bound_and_checked_at_start_up() -> None:
    hash_only = resolve_reward_fn("math", (), {"extract": ["hash"], "format_weight": 0.5})
    assert hash_only("#### 5", {"answer": 5}) == {"correct": 1.0, "format": 0.5}
    assert hash_only("\\boxed{5}", {"answer": 5}) == NOTHING  # the box is not a configured form
    with pytest.raises(ValueError, match=r"does not accept nope, tolerance .*extract"):
        resolve_reward_fn("math", (), {"nope": 1, "tolerance": 2})
    with pytest.raises(ValueError, match="does not accept completion"):
        resolve_reward_fn("math", (), {"completion": "x"})
    with pytest.raises(ValueError, match=r"env.reward_fn_args: reward function 'math': .*extract = \['boxd'\]"):
        resolve_reward_fn("math", (), {"extract": ["boxd"]})
    with pytest.raises(ValueError, match="timeout_s"):
        resolve_reward_fn("math", (), {"timeout_s": 0})
    assert resolve_reward_fn("arithmetic") is arithmetic_reward
    with pytest.raises(ValueError, match=r"'mth': not a built-in name \(arithmetic, math\)"):
        resolve_reward_fn("mth")


def test_the_math_alias_through_a_toml_config(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[env]\nreward_fn = "math"\nreward_fn_args = {extract = ["boxed", "hash"], format_weight = 0.2}\n')
    env = load_config(path).env
    assert env.reward_fn == "math" and env.reward_fn_args == {"extract": ["boxed", "hash"], "format_weight": 0.2}
    function = resolve_reward_fn(env.reward_fn, env.plugin_paths, env.reward_fn_args)
    assert function("#### 72", {"answer": GSM8K}) == {"correct": 1.0, "format": 0.2}
    with pytest.raises(ValueError, match="not a built-in name"):
        EnvConfig(reward_fn="maths")
    with pytest.raises(ValueError, match="reward_fn_args"):
        EnvConfig(reward_fn_args={"extract": {"nested": "table"}})


def test_without_math_verify_the_alias_says_what_to_install(monkeypatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else find_spec(name)
    )
    with pytest.raises(ImportError, match=r"pip install 'tandem-rl\[math\]'"):
        resolve_reward_fn("math")
    with pytest.raises(ImportError, match=r"pip install 'tandem-rl\[math\]'"):
        score("\\boxed{\\{1,2\\}}", "\\{2,1\\}")  # needs sympy: refused before any worker starts
    assert score("\\boxed{5}", 5) == RIGHT  # the fast path needs no package


# ------------------------------------------------------------------------------------ sympy in the workers


@pytest.mark.integration
@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", RIGHT),  # sets
        ("\\boxed{(1,2]}", "[1,2)", WRONG_FORMATTED),  # intervals, ends differ
        ("\\boxed{[1,2)}", "x \\in [1,2)", RIGHT),
        ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt2}{2}", RIGHT),
        ("\\boxed{1+2x}", "2x+1", RIGHT),
        ("The answer is $0.333333$", "\\frac13", RIGHT),  # math-verify's 6-digit float rounding
        ("\\boxed{50\\%}", "0.5", RIGHT),
        ("\\boxed{\\frac{3}{2}\\text{ cm}}", "1.5", RIGHT),  # units text
        ("\\boxed{3}", "x = 3", RIGHT),  # an equation's value (gold first: verify is not symmetric)
        ("\\boxed{\\pi}", "3.14159", WRONG_FORMATTED),
        ("\\boxed{\\frac{1}{2}}", MATH_SOLUTION, RIGHT),
        ("\\boxed{\\frac{1}{3}}", MATH_SOLUTION, WRONG_FORMATTED),
        ("\\boxed{1/2}}}", MATH_SOLUTION, RIGHT),  # stray closing braces after a whole box
    ],
)
def test_sympy_equivalence(completion: str, gold: str, expected: dict[str, float]) -> None:
    assert score(completion, gold) == expected


@pytest.mark.integration
def test_a_pathological_answer_is_cut_at_the_limit_and_the_worker_restarts() -> None:
    """`9^{9^{9^{9}}}` makes sympy compute a power of ~10^(3.7e8) digits in C (it never returns); a 20 KB sum
    takes math-verify's parser ~3 s here. Each is scored 0 within timeout_s plus a kill, and the next comparison
    runs on the replacement worker, which started importing at the kill."""
    limit = 1.0
    mr.shutdown()
    started = time.perf_counter()
    assert score("\\boxed{\\{1\\}}", "\\{1\\}")["correct"] == 1.0  # both sides equal: the fast path
    assert score("\\boxed{\\{2,1\\}}", "\\{1,2\\}", timeout_s=limit)["correct"] == 1.0
    cold = time.perf_counter() - started  # a worker's start (imports) and one comparison
    print(f"\ncold worker start + one comparison: {cold:.2f} s (AMD EPYC avx2, 2 shared cores)")
    before = mr.stats()
    for completion, gold in [("\\boxed{9^{9^{9^{9}}}}", "5"), ("\\boxed{5}", "+".join(["x"] * 10_000))]:
        started = time.perf_counter()
        assert score(completion, gold, timeout_s=limit) == WRONG_FORMATTED
        took = time.perf_counter() - started
        print(f"{completion[:22]} against {gold[:12]}: scored 0 in {took:.2f} s (limit {limit:g} s)")
        # the limit, plus a SIGKILL, a wait and the replacement's fork/exec (~10 ms), plus 1 s of scheduling slack
        # on a 2-core machine other tests share
        assert took < limit + 1.0, took
        started = time.perf_counter()
        assert score("\\boxed{\\{3,1\\}}", "\\{1,3\\}", timeout_s=limit)["correct"] == 1.0
        # the replacement's imports (at most a cold start: they began at the kill), doubled for a loaded machine
        assert time.perf_counter() - started < 2 * cold + 1.0
    after = mr.stats()
    assert after["timeouts"] - before["timeouts"] == 2 and after["restarts"] - before["restarts"] == 2


@pytest.mark.integration
def test_sympy_comparisons_cost_milliseconds() -> None:
    score("\\boxed{\\{2,1\\}}", "\\{1,2\\}")  # a warm worker
    cases = [
        ("\\boxed{\\{2,1\\}}", "\\{1,2\\}"),
        ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt2}{2}"),
        ("\\boxed{1+2x}", "2x+1"),
    ]
    timings = []
    for completion, gold in cases * 5:
        started = time.perf_counter()
        assert score(completion, gold)["correct"] == 1.0
        timings.append(time.perf_counter() - started)
    timings.sort()
    print(f"\nsympy path: median {timings[len(timings) // 2] * 1e3:.1f} ms, max {timings[-1] * 1e3:.1f} ms a call")
    assert timings[-1] < mr.DEFAULT_TIMEOUT_S  # none of these ordinary answers comes near the limit


@pytest.mark.integration
def test_the_math_alias_through_the_reward_scorer() -> None:
    from actors.rewards.functions import RewardScorer

    scorer = RewardScorer(EnvConfig(reward_fn="math", reward_fn_args={"format_weight": 0.2}))
    try:
        right = scorer.score("Thus $x \\in \\boxed{[0, 1]}$.", {"answer": "[0,1]"})
        wrong = scorer.score("\\boxed{\\{1,3\\}}", {"answer": "\\{1,2\\}"})
        unreadable = scorer.score("\\boxed{1}", {"answer": ""})
    finally:
        scorer.close()
    assert right.error is None and right.reward == pytest.approx(1.2) and right.components["correct"] == 1.0
    assert wrong.error is None and wrong.reward == pytest.approx(0.2)
    assert unreadable.error.startswith("ValueError: metadata['answer']") and scorer.errors == 1


@pytest.mark.integration
def test_workers_outlive_the_thread_that_asked_first() -> None:
    """PR_SET_PDEATHSIG fires when the thread that started a worker ends: the pool starts them from its launcher
    thread, so a TimedFunction thread that asked first and then ended (replaced after a timeout) kills none."""
    mr.shutdown()
    asker = threading.Thread(target=lambda: score("\\boxed{\\{2,1\\}}", "\\{1,2\\}"))
    asker.start()
    asker.join()
    before = mr.stats()["restarts"]
    time.sleep(0.5)  # SIGKILL on the asker's end would have landed by now
    assert score("\\boxed{\\{3,1\\}}", "\\{1,3\\}")["correct"] == 1.0 and mr.stats()["restarts"] == before


PARENT = """
import json
from common.math_verify_worker import VerifierPool
pool = VerifierPool(1)
worker = pool._take()
worker.wait_ready()
worker.process.stdin.write(json.dumps({"gold": "5", "answer": "9^{9^{9^{9}}}"}).encode() + b"\\n")
worker.process.stdin.flush()
print(worker.process.pid, flush=True)
"""


@pytest.mark.integration
def test_a_stuck_worker_dies_with_its_parent(tmp_path) -> None:
    """A parent that exits while its worker computes forever (no stdin EOF is read then) leaves no orphan: the
    kernel kills the worker (PR_SET_PDEATHSIG)."""
    # stderr to a file, not a pipe: a surviving worker inherits it, and run() would wait for the pipe to close
    with (tmp_path / "stderr").open("w") as stderr:
        parent = subprocess.run(
            [sys.executable, "-c", PARENT],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            timeout=120,
            check=True,
            cwd=Path(__file__).parents[2],
        )
    pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 5.0  # the kill is the kernel's, at the parent's exit: well under a second
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()
    if alive:
        os.kill(pid, 9)
    assert not alive, "the worker outlived its parent"
