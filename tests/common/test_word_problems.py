"""The embedded word problems: reproducible, prefix-stable, a fixed ~20% held out by question text, GSM8K-shaped
answers whose arithmetic is right, the `word_problems` eval set, and `env.kind = "word_problems"`."""

from __future__ import annotations

import math
import re

import pytest

from common.config import ConfigError, load_config
from common.eval_metrics import Completion, expected_answer, score_completion
from common.eval_sets import WORD_PROBLEMS_LEVEL, eval_set, parse_set_names
from common.tasks import ANSWER_MARKER, arithmetic_reward, evaluate_expression, total_reward
from common.word_problems import (
    DIFFICULTIES,
    HELD_OUT_PERCENT,
    INSTRUCTION,
    MAX_SHOTS,
    is_held_out,
    word_problem_prompts,
)

_EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")
_LAST_LINE = re.compile(rf"^{ANSWER_MARKER} (\d+)$")


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
@pytest.mark.parametrize("split", ["all", "train", "held_out"])
def test_same_arguments_same_records_and_a_shorter_list_is_a_prefix(difficulty: int, split: str) -> None:
    long = word_problem_prompts(60, seed=3, difficulty=difficulty, split=split)
    assert word_problem_prompts(60, seed=3, difficulty=difficulty, split=split) == long
    assert word_problem_prompts(25, seed=3, difficulty=difficulty, split=split) == long[:25]
    assert [r.prompt_id for r in long] == list(range(60))
    other = word_problem_prompts(60, seed=4, difficulty=difficulty, split=split)
    assert [r.metadata["question"] for r in other] != [r.metadata["question"] for r in long]


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_the_splits_are_disjoint_and_partition_the_all_stream(difficulty: int) -> None:
    everything = word_problem_prompts(3000, seed=0, difficulty=difficulty)
    train = word_problem_prompts(3000, seed=0, difficulty=difficulty, split="train")
    held_out = word_problem_prompts(600, seed=0, difficulty=difficulty, split="held_out")
    train_questions = {r.metadata["question"] for r in train}
    held_out_questions = {r.metadata["question"] for r in held_out}
    assert not train_questions & held_out_questions
    assert all(is_held_out(q) for q in held_out_questions) and not any(is_held_out(q) for q in train_questions)
    # each split is the `all` stream with the other side taken out, in the same order
    questions = [r.metadata["question"] for r in everything]
    assert [r.metadata["question"] for r in train][:2000] == [q for q in questions if not is_held_out(q)][:2000]
    assert [r.metadata["question"] for r in held_out][:400] == [q for q in questions if is_held_out(q)][:400]


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_about_a_fifth_of_the_questions_are_held_out(difficulty: int) -> None:
    distinct = {r.metadata["question"] for r in word_problem_prompts(5000, seed=0, difficulty=difficulty)}
    n = len(distinct)
    share = sum(is_held_out(q) for q in distinct) / n
    p = HELD_OUT_PERCENT / 100
    # SHA-256 picks each distinct question independently with probability p: the share is binomial, standard
    # deviation sqrt(p (1 - p) / n) (~0.006 for n ~ 5000); 5 standard deviations is a bound a fair hash misses
    # with probability < 1e-6, and a split of 15% or 25% (a wrong modulus or threshold) far exceeds it.
    assert n > 2000  # the levels are not so small that the share is meaningless
    assert abs(share - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_the_split_is_by_text_and_folds_whitespace() -> None:
    question = word_problem_prompts(1, seed=0, difficulty=1)[0].metadata["question"]
    assert is_held_out(question) == is_held_out("  " + question.replace(" ", "  ") + "\n")


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_answers_are_gsm8k_worked_solutions_whose_arithmetic_is_right(difficulty: int) -> None:
    for record in word_problem_prompts(300, seed=1, difficulty=difficulty):
        solution = str(record.metadata["answer"])
        *steps, last = solution.split("\n")
        matched = _LAST_LINE.match(last)
        assert matched, f"last line {last!r} is not '#### n'"
        equations = [_EQUATION.findall(line) for line in steps]
        assert all(len(found) == 1 for found in equations), solution  # one `a op b = c` per step line
        carried = None
        for ((a, op, b, c),) in equations:
            if op == "/":
                assert int(a) % int(b) == 0 and int(a) // int(b) == int(c), solution  # an exact share
            else:
                assert evaluate_expression(f"{a} {op} {b}") == int(c), solution
            assert carried is None or int(a) == carried, solution  # each step starts from the last one's result
            carried = int(c)
            assert int(c) >= 0
        assert carried == int(matched.group(1)), solution  # n is the last step's result
        assert len(equations) == {1: 1, 2: 1, 3: 2, 4: 2, 5: 3}[difficulty]
        first_operand = equations[0][0][0]
        assert re.search(rf"\b{first_operand}\b", str(record.metadata["question"]))


def test_a_row_is_the_question_and_the_instruction_with_its_metadata() -> None:
    record = word_problem_prompts(1, seed=0, difficulty=2)[0]
    question = record.metadata["question"]
    assert record.messages == [{"role": "user", "content": f"{question} {INSTRUCTION}"}]
    assert set(record.metadata) == {"answer", "question", "difficulty"} and record.metadata["difficulty"] == 2
    assert ANSWER_MARKER in INSTRUCTION


@pytest.mark.parametrize("shots", range(1, MAX_SHOTS + 1))
def test_worked_examples_are_train_questions_answered_by_their_solutions(shots: int) -> None:
    plain = word_problem_prompts(5, seed=0, difficulty=3, split="held_out")
    shown = word_problem_prompts(5, seed=0, difficulty=3, split="held_out", shots=shots)
    for a, b in zip(plain, shown, strict=True):
        assert a.metadata == b.metadata and b.messages[-1] == a.messages[-1]
        examples = b.messages[:-1]
        assert [m["role"] for m in examples] == ["user", "assistant"] * shots
        for question, solution in zip(examples[::2], examples[1::2], strict=True):
            assert not is_held_out(question["content"].removesuffix(f" {INSTRUCTION}"))
            assert _LAST_LINE.match(solution["content"].split("\n")[-1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"difficulty": 6}, "difficulty must be one of"),
        ({"difficulty": 1, "split": "test"}, "split must be one of"),
        ({"difficulty": 1, "shots": MAX_SHOTS + 1}, "shots must be in"),
    ],
)
def test_bad_arguments_say_what_is_allowed(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        word_problem_prompts(4, seed=0, **kwargs)
    with pytest.raises(ValueError, match="num_prompts must be >= 0"):
        word_problem_prompts(-1, seed=0, difficulty=1)


def test_a_worked_solution_reference_scores_by_its_final_number() -> None:
    record = word_problem_prompts(1, seed=0, difficulty=3)[0]
    answer = int(str(record.metadata["answer"]).rsplit(ANSWER_MARKER, 1)[1])
    assert expected_answer(record.metadata) == answer
    right = f"Some steps, 1 + 2 = 3.\n{ANSWER_MARKER} {answer}"
    wrong = f"{ANSWER_MARKER} {answer + 1}"
    unmarked = f"So the answer is {answer}."
    assert total_reward(arithmetic_reward(right, record.metadata))[0] == pytest.approx(1.1)
    assert arithmetic_reward(wrong, record.metadata)["correct"] == 0.0
    verdicts = [
        score_completion(Completion(text, 10, "stop"), record.metadata, arithmetic_reward)
        for text in (right, wrong, unmarked)
    ]
    assert [(v.strict, v.lenient) for v in verdicts] == [(True, True), (False, False), (False, True)]
    with pytest.raises(ValueError, match="no number after its last '####'"):
        arithmetic_reward(right, {"answer": f"{ANSWER_MARKER} seven"})


def test_the_eval_set_holds_distinct_held_out_questions_never_trained_on() -> None:
    assert parse_set_names("word_problems,arithmetic") == ["word_problems", "arithmetic"]
    records = eval_set("word_problems", limit=60).records
    questions = [r.metadata["question"] for r in records]
    assert len(records) == 60 and len(set(questions)) == 60 and all(is_held_out(q) for q in questions)
    assert all(r.metadata["difficulty"] == WORD_PROBLEMS_LEVEL for r in records)
    assert [r.prompt_id for r in records] == list(range(60))
    assert eval_set("word_problems", limit=10).records == records[:10]
    trained = word_problem_prompts(3000, seed=0, difficulty=WORD_PROBLEMS_LEVEL, split="train")
    assert not {r.metadata["question"] for r in trained} & set(questions)
    one_shot = eval_set("word_problems", limit=3, shots=1).records
    assert [r.messages[-1] for r in one_shot] == [r.messages[-1] for r in records[:3]]
    assert len(one_shot[0].messages) == 3


def test_the_level_2_eval_set_holds_held_out_level_2_questions() -> None:
    records = eval_set("word_problems-d2", limit=40).records
    questions = [r.metadata["question"] for r in records]
    assert len(set(questions)) == 40 and all(is_held_out(q) for q in questions)
    assert {r.metadata["difficulty"] for r in records} == {2}
    trained = word_problem_prompts(3000, seed=0, difficulty=2, split="train")
    assert not {r.metadata["question"] for r in trained} & set(questions)


def test_env_kind_word_problems_is_a_config_value_the_buffer_loads() -> None:
    from buffers.service import load_prompt_records

    config = load_config(None, ["--env.kind", "word_problems", "--env.difficulty", "2", "--env.num_prompts", "40"])
    records = load_prompt_records(config.env, seed=config.run.seed)
    assert records == word_problem_prompts(40, seed=config.run.seed, difficulty=2, split="train")
    with pytest.raises(ConfigError, match="word_problems"):  # the error lists the kinds there are
        load_config(None, ["--env.kind", "word_problem"])


def test_the_math_verifier_scores_the_rows_by_their_final_number() -> None:
    math_reward = pytest.importorskip("common.math_reward").math_reward  # env.reward_fn = "math"
    for record in word_problem_prompts(20, seed=2, difficulty=5):
        solution = str(record.metadata["answer"])
        answer = int(solution.rsplit(ANSWER_MARKER, 1)[1])
        assert math_reward(solution, record.metadata)["correct"] == 1.0  # the reference itself is right
        assert math_reward(f"{ANSWER_MARKER} {answer}", record.metadata)["correct"] == 1.0
        assert math_reward(f"\\boxed{{{answer}}}", record.metadata)["correct"] == 1.0
        assert math_reward(f"{ANSWER_MARKER} {answer + 1}", record.metadata)["correct"] == 0.0
