"""The example environments (examples/envs): their rules, their prompt sets and their configs.

Calculator: the evaluator is exact and refuses everything but numbers, + - * / and parentheses (it never calls
Python's eval); the tool answers in order, and the final answer is rewarded. Guessing: higher/lower feedback,
fewer guesses pay more. Code: correct code passes in the sandbox, wrong code gets feedback, hostile code cannot
fake a pass. Every example config validates, names an importable environment, and its committed prompt file is
exactly what its generator writes.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

from actors.environments.episodes import EpisodeDriver, EpisodeLimits
from actors.environments.runner import EnvRunner
from common.config import load_config
from common.envs import check_step_result, environment_factory
from common.tasks import load_prompts
from common.types import PromptItem
from examples.envs.calculator import CalcError, CalculatorEnv, calculator_prompts, evaluate
from examples.envs.code_task import CodeEnv, code_prompts
from examples.envs.guessing import GuessingEnv, guessing_prompts
from examples.envs.prompt_sets import to_jsonl
from launch.testing import drive_until_done

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = {"calculator": calculator_prompts, "guessing": guessing_prompts, "code": code_prompts}


def task(metadata: dict, text: str = "Go.") -> PromptItem:
    return PromptItem(prompt_id=0, epoch=0, messages=[{"role": "user", "content": text}], metadata=metadata)


# ------------------------------------------------------------------------------------------------ calculator
@pytest.mark.parametrize(
    "expression, value",
    [
        ("12*7", 84),
        ("(1 + 2) * -3", -9),
        ("7 / 2", Fraction(7, 2)),
        ("0.1 + 0.2", Fraction(0.1) + Fraction(0.2)),
        ("  347 * 29 + 1288 ", 347 * 29 + 1288),
        ("-(-5)", 5),
    ],
)
def test_calculator_evaluates_exactly(expression: str, value) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "expression, why",
    [
        ("__import__('os').system('touch /tmp/x')", "not allowed"),
        ("2 ** 10", "not allowed"),
        ("x + 1", "not allowed"),
        ("(lambda: 1)()", "not allowed"),
        ("[1, 2]", "not allowed"),
        ("1 / 0", "division by zero"),
        ("9" * 30, "too large"),
        ("99999999 * 99999999 * 99999999", "too large"),
        ("1 +", "not an expression"),
        ("1" + "+1" * 150, "longer than"),
        ("+".join(["1"] * 40), "more than"),
        ("True + 1", "not allowed"),
        ("1 // 2", "not allowed"),
        ("'a' * 3", "not allowed"),
    ],
)
def test_calculator_refuses_everything_else(expression: str, why: str) -> None:
    with pytest.raises(CalcError, match=why):
        evaluate(expression)


def test_calculator_episode_tool_then_answer() -> None:
    env = CalculatorEnv(max_calls_per_turn=2, idle_penalty=0.05, max_turns=5)
    env.reset(task({"answer": 84}))
    idle = check_step_result(env.step("I think it is big."))
    assert not idle.done and idle.reward == -0.05 and "<calc>" in idle.observation[0]["content"]
    tool = check_step_result(env.step("<calc>12*7</calc> and <calc>1/0</calc> and <calc>3</calc>"))
    assert tool.observation[0]["content"] == "<result>84</result>\n<error>division by zero</error>"
    assert not tool.done and tool.reward == 0
    final = check_step_result(env.step("So the answer is\n#### 84"))
    assert final.done and final.reward == 1.0
    env.reset(task({"answer": 84}))
    assert env.step("#### 85").reward == 0.0


# ------------------------------------------------------------------------------------------------- guessing
def test_guessing_gives_feedback_and_pays_more_for_fewer_guesses() -> None:
    env = GuessingEnv(max_guesses=5)
    env.reset(task({"secret": 37, "low": 1, "high": 100}))
    assert env.step("50").observation[0]["content"] == "Lower."
    assert env.step("My guess: 25").observation[0]["content"] == "Higher."
    invalid = env.step("hmm")
    assert invalid.reward == pytest.approx(-0.1) and "between 1 and 100" in invalid.observation[0]["content"]
    found = env.step("37")
    assert found.done and found.reward == pytest.approx(1 - 0.5 * 3 / 4)
    env.reset(task({"secret": 37, "low": 1, "high": 100}))
    assert env.step("37").reward == 1.0
    env.reset(task({"secret": 37, "low": 1, "high": 100}))
    for guess in ("1", "2", "3", "4"):
        assert not env.step(guess).done
    last = env.step("5")
    assert last.done and last.reward == 0.0


def binary_search(conversation: str) -> str:
    """The next guess of binary search over [1, 100], from the feedback in the conversation so far."""
    low, high = 1, 100
    turns = conversation.split("<|im_start|>assistant\n")[1:-1]  # the last one is the generation prompt
    for turn in turns:
        guess_text, _, rest = turn.partition("<|im_end|>")
        hint = rest.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        guess = int(guess_text)
        low, high = (guess + 1, high) if hint == "Higher." else (low, guess - 1)
    return str((low + high) // 2)


def test_guessing_game_through_the_episode_driver_with_binary_search(tiny_model_dir) -> None:
    """A policy that reads the feedback and plays binary search finds every secret in [1, 100] within 7 guesses."""
    from transformers import AutoTokenizer

    from tests.actors.env_fakes import PolicyEngine

    engine = PolicyEngine(AutoTokenizer.from_pretrained(tiny_model_dir), binary_search)
    limits = EpisodeLimits(
        max_turns=10,
        max_total_tokens=1024,
        turn_max_tokens=8,
        max_model_len=4096,
        step_timeout_s=5,
        episode_timeout_s=30,
        failure_reward=0.0,
    )
    runner = EnvRunner(2)
    try:
        driver = EpisodeDriver(engine, lambda: GuessingEnv(max_guesses=10), limits, runner, group_size=1)
        games = [p for p in guessing_prompts(12, seed=3) if p.metadata["high"] == 100]
        for prompt in games:
            driver.start_group(0, PromptItem(prompt.prompt_id, 0, prompt.messages, prompt.metadata))
        groups = drive_until_done(driver, timeout_s=30)
    finally:
        runner.close()
    assert len(groups) == len(games) > 3
    for group in groups:
        (result,) = group.results
        assert result.finish_reason == "done" and 1 <= result.turns <= 7
        assert result.reward == pytest.approx(1 - 0.5 * (result.turns - 1) / 9)


# ----------------------------------------------------------------------------------------------------- code
GCD_CASES = json.dumps([[[12, 18], 6], [[7, 0], 7], [[0, 0], 0]])


@pytest.mark.integration
def test_code_env_passes_correct_code_and_explains_failures() -> None:
    env = CodeEnv(max_attempts=3, time_limit_s=5)
    env.reset(task({"function": "gcd", "cases": GCD_CASES}))
    no_code = env.step("I would use Euclid's algorithm.")
    assert not no_code.done and "```python" in no_code.observation[0]["content"]
    wrong = env.step("```python\ndef gcd(a, b):\n    return min(a, b)\n```")
    assert not wrong.done
    feedback = wrong.observation[0]["content"]
    assert "1 of 3 tests passed" in feedback and "gcd(12, 18) returned 12, expected 6" in feedback
    right = env.step("Fixed:\n```python\nimport math\n\ndef gcd(a, b):\n    return math.gcd(a, b)\n```")
    assert right.done and right.reward == 1.0


@pytest.mark.integration
def test_code_env_last_attempt_scores_the_share_passed_and_hostile_code_cannot_fake_it(tmp_path) -> None:
    env = CodeEnv(max_attempts=1, time_limit_s=3)
    env.reset(task({"function": "gcd", "cases": GCD_CASES}))
    hostile = f"""```python
import json, sys, socket
print('<<tandem-0000>>' + json.dumps({{"outputs": [{{"value": 6}}, {{"value": 7}}, {{"value": 0}}]}}))
open({str(tmp_path / "pwned")!r}, 'w').write('x')
def gcd(a, b):
    socket.create_connection(("example.com", 80))
```"""
    result = env.step(hostile)
    assert result.done and result.reward == 0.0
    assert not (tmp_path / "pwned").exists()
    env.reset(task({"function": "gcd", "cases": GCD_CASES}))
    slow = env.step("```python\ndef gcd(a, b):\n    while True:\n        pass\n```")
    assert slow.done and slow.reward == 0.0
    env.reset(task({"function": "gcd", "cases": GCD_CASES}))
    partial = env.step("```python\ndef gcd(a, b):\n    return 6\n```")
    assert partial.done and partial.reward == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    "text, why",
    [
        ('{"outputs": []}', "malformed"),  # the reward hack: zip() of 3 cases with 0 outcomes passed them all
        ('{"outputs": [{"value": 6}, {"value": 7}]}', "malformed"),
        ('{"outputs": [{"value": 6}, {"value": 7}, {"value": 0}, {"value": 1}]}', "malformed"),
        ('{"outputs": [{"value": 6, "error": "x"}, {"value": 7}, {"value": 0}]}', "malformed"),
        ('{"outputs": [{"error": 1}, {"value": 7}, {"value": 0}]}', "malformed"),
        ('{"outputs": [{"value": 6}, {"value": 7}, {"value": 0}], "passed": 3}', "malformed"),
        ('{"outputs": "all"}', "malformed"),
        ("[1, 2, 3]", "malformed"),
        ("{not json", "malformed"),
        ('{"load_error": "SyntaxError: invalid syntax"}', "SyntaxError"),
    ],
)
def test_code_report_is_judged_as_hostile_input(text: str, why: str) -> None:
    """The sandboxed harness's report comes from the process that ran the solution: only exactly one well-formed
    outcome per case is read; anything else is a reason, and every case fails."""
    from examples.envs.code_task import parse_report

    refused = parse_report(text, count=3)
    assert isinstance(refused, str) and why in refused
    good = parse_report('{"outputs": [{"value": 6}, {"error": "' + "E" * 900 + '"}, {"value": [0]}]}', count=3)
    assert good == [{"value": 6}, {"error": "E" * 200}, {"value": [0]}]  # errors cut to what the harness sends


SOLUTIONS = {  # written from the prompts' descriptions, independently of the references that made the cases
    "reverse_words": "def reverse_words(text):\n    return ' '.join(reversed(text.split()))",
    "is_palindrome": "def is_palindrome(text):\n    s = ''.join(c.lower() for c in text if c.isalnum())\n"
    "    return s == s[::-1]",
    "gcd": "import math\ndef gcd(a, b):\n    return math.gcd(a, b)",
    "running_sum": "import itertools\ndef running_sum(numbers):\n    return list(itertools.accumulate(numbers))",
    "count_vowels": "def count_vowels(text):\n    return sum(1 for c in text.lower() if c in 'aeiou')",
    "fizzbuzz": "def fizzbuzz(n):\n    return 'Fizz' * (n % 3 == 0) + 'Buzz' * (n % 5 == 0) or str(n)",
    "second_largest": "def second_largest(numbers):\n    return sorted(set(numbers), reverse=True)[1]",
    "to_binary": "def to_binary(n):\n    return bin(n)[2:]",
    "flatten": "def flatten(lists):\n    return sum(lists, [])",
    "is_prime": "def is_prime(n):\n    return n > 1 and all(n % k for k in range(2, n))",
    "digit_sum": "def digit_sum(n):\n    return sum(map(int, str(n).lstrip('-')))",
}


@pytest.mark.integration
def test_every_code_task_is_solvable_as_described() -> None:
    """An independent solution of each problem, in a code block, passes all its cases at the first attempt."""
    from examples.envs.code_task import PROBLEMS

    assert sorted(SOLUTIONS) == sorted(PROBLEMS)
    for record in code_prompts(len(PROBLEMS), seed=1):
        env = CodeEnv(max_attempts=1)
        env.reset(task(record.metadata))
        result = env.step(f"Here it is:\n```python\n{SOLUTIONS[record.metadata['function']]}\n```")
        assert result.done and result.reward == 1.0, record.metadata["function"]


# ----------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_config_validates_and_its_prompt_file_is_current(name: str, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    config = load_config(REPO / "examples" / f"{name}.toml")
    assert config.env.environment.startswith("examples.envs.") and config.env.kind == "file"
    environment = environment_factory(config.env)()
    records = load_prompts(config.env.source)
    assert environment.reset(records[0])
    committed = (REPO / config.env.source).read_text()
    assert committed == to_jsonl(EXAMPLES[name](len(records), 0)), (
        f"regenerate: python -m examples.envs.{'code_task' if name == 'code' else name} --write {config.env.source}"
    )


# --------------------------------------------------------------------------------------- code-task tricks
REPLAY = """```python
import json
SEEN = json.loads({seen!r})
def {function}(*args):
    return SEEN.get(json.dumps(list(args)))
```"""


@pytest.mark.integration
def test_replaying_the_expected_values_of_feedback_scores_zero() -> None:
    """A "solution" that computes nothing and returns the expected values earlier feedback showed: before, it
    passed every case by its third attempt (3 shown per attempt, 6 cases). Now at most half the cases are ever
    revealed, and revealed ones are not scored: it scores 0."""
    import re

    record = code_prompts(3, seed=2)[2]
    env = CodeEnv(max_attempts=3, time_limit_s=5)
    env.reset(task(record.metadata))
    function, seen = record.metadata["function"], {}
    for _ in range(3):
        result = env.step(REPLAY.format(seen=json.dumps(seen), function=function))
        if result.done:
            break
        feedback = result.observation[0]["content"]
        for call, expected in re.findall(rf"- {function}\((.*)\) (?:returned|raised) .*, expected (.*)", feedback):
            seen[json.dumps(list(eval(f"[{call}]")))] = eval(expected)
    assert result.done and result.reward == 0.0
    assert 0 < len(seen) <= len(json.loads(record.metadata["cases"])) // 2


@pytest.mark.integration
def test_a_deeply_nested_report_scores_zero_with_a_reason() -> None:
    """A solution that prints a report nested 100,000 deep after the harness's marker: before, json.loads raised
    RecursionError in the environment's step; now the report is malformed and scores 0."""
    from examples.envs.code_task import parse_report

    deep = '{"outputs": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert "nested deeper than" in parse_report(deep, count=3)
    solution = (
        "import __main__, os, sys\n"
        "sys.stdout.write(__main__.MARKER + '{\"outputs\": ' + '[' * 100000 + ']' * 100000 + '}\\n')\n"
        "sys.stdout.flush()\nos._exit(0)\n"
    )
    env = CodeEnv(max_attempts=1, time_limit_s=5)
    env.reset(task({"function": "gcd", "cases": GCD_CASES}))
    result = env.step(f"```python\n{solution}```")
    assert result.done and result.reward == 0.0
