"""The data that ships for the RLHF stages: SFT chats and preference pairs of the embedded arithmetic task.

.venv/bin/python -m pytest tests/common/test_rlhf_data.py -q
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from common.rlhf_data import (
    REJECTION_KINDS,
    arithmetic_preference_rows,
    arithmetic_sft_rows,
    main,
    rejected_reply,
)
from common.tasks import (
    ANSWER_MARKER,
    DIFFICULTIES,
    arithmetic_prompts,
    arithmetic_reward,
    evaluate_expression,
    is_held_out,
    parse_answer,
    total_reward,
)

NUMBER = re.compile(r"-?\d+")


def _expression(user_message: dict[str, str]) -> str:
    matched = re.fullmatch(r"What is (.+)\? Put the final answer after '####'\.", user_message["content"])
    assert matched, user_message
    return matched.group(1)


def _assert_correct_and_formatted(reply: str, answer: int) -> None:
    scores = arithmetic_reward(reply, {"answer": answer})
    assert scores["correct"] == 1.0 and scores["format"] > 0, reply
    marker_line = reply.rsplit("\n", 1)[1]
    assert marker_line == f"{ANSWER_MARKER} {answer}", reply  # the answer after the marker, alone on the last line
    assert parse_answer(reply) == (answer, True)


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_sft_rows_are_the_rl_prompts_with_correct_formatted_replies(difficulty: int) -> None:
    rows = arithmetic_sft_rows(100, seed=5, difficulty=difficulty)
    records = arithmetic_prompts(100, seed=5, difficulty=difficulty, split="train")
    assert len(rows) == 100
    for row, record in zip(rows, records, strict=True):
        assert set(row) == {"messages"}
        user, assistant = row["messages"]
        assert user == record.messages[0]  # exactly the RL prompt
        assert assistant["role"] == "assistant"
        _assert_correct_and_formatted(assistant["content"], int(record.metadata["answer"]))
    replies = [row["messages"][1]["content"] for row in rows]
    short = [reply for reply in replies if re.fullmatch(r"[^\n]+ = -?\d+\n#### -?\d+", reply)]
    assert 0.3 < len(short) / len(replies) < 0.7  # the short form is half the replies (of 4 phrasings, listed twice)
    assert any(" equals " in reply for reply in replies) and any("step by step" in reply for reply in replies)


def _swapped_values(expression: str) -> set[int]:
    tokens = expression.split(" ")
    swap = {"+": "-", "-": "+", "*": "+"}
    return {
        evaluate_expression(" ".join([*tokens[:i], swap[t], *tokens[i + 1 :]]))
        for i, t in enumerate(tokens)
        if t in swap
    }


def _assert_fails_as_its_kind(kind: str, reply: str, expression: str, answer: int) -> None:
    """Each kind fails the verifier in its own way (correct / format / what is after the marker)."""
    scores = arithmetic_reward(reply, {"answer": answer})
    value, formatted = parse_answer(reply)
    numbers = [int(n) for n in NUMBER.findall(reply)]
    if kind in ("wrong_near", "wrong_operation"):  # right format, wrong value
        assert scores == {"correct": 0.0, "format": 0.1} and formatted
        assert reply.rsplit("\n", 1)[1] == f"{ANSWER_MARKER} {int(value)}"
        near = abs(value - answer) in (1, 2, 10)
        assert near if kind == "wrong_near" else (value in _swapped_values(expression) or near)
    elif kind == "no_marker_right":  # right value, no marker
        assert scores == {"correct": 1.0, "format": 0.0} and ANSWER_MARKER not in reply and value == answer
    elif kind == "no_marker_wrong":
        assert scores == {"correct": 0.0, "format": 0.0} and ANSWER_MARKER not in reply and value != answer
    elif kind == "marker_no_number":
        assert scores == {"correct": 0.0, "format": 0.0} and ANSWER_MARKER in reply and not numbers
        assert value is None
    elif kind == "rambling_wrong":  # names the right answer on the way, ends on a wrong one
        assert scores == {"correct": 0.0, "format": 0.0} and ANSWER_MARKER not in reply
        assert answer in numbers and numbers[-1] != answer and len(reply) > 150
    else:
        raise AssertionError(f"a kind without a test: {kind}")


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_every_pair_prefers_the_verifiers_choice_and_each_kind_fails_its_own_way(difficulty: int) -> None:
    rows = arithmetic_preference_rows(200, seed=2, difficulty=difficulty)
    records = arithmetic_prompts(200, seed=2, difficulty=difficulty, split="train")
    for row, record in zip(rows, records, strict=True):
        assert set(row) == {"prompt", "chosen", "rejected", "rejection"}
        assert row["prompt"] == record.messages  # exactly the RL prompt
        (chosen,), (rejected,) = row["chosen"], row["rejected"]
        assert chosen["role"] == rejected["role"] == "assistant"
        answer, expression = int(record.metadata["answer"]), str(record.metadata["expression"])
        _assert_correct_and_formatted(chosen["content"], answer)
        _assert_fails_as_its_kind(row["rejection"], rejected["content"], expression, answer)
        chosen_score, _ = total_reward(arithmetic_reward(chosen["content"], record.metadata))
        rejected_score, _ = total_reward(arithmetic_reward(rejected["content"], record.metadata))
        assert rejected_score < chosen_score
    # Every kind, in the shares of REJECTION_KINDS (exact over whole blocks of 20: 200 rows = 10 blocks).
    assert Counter(row["rejection"] for row in rows) == {kind: 10 * count for kind, count in REJECTION_KINDS.items()}
    assert set(REJECTION_KINDS) == {row["rejection"] for row in rows[:20]}


def test_correctness_decides_most_pairs() -> None:
    rows = arithmetic_preference_rows(200, seed=0, difficulty=1)
    records = arithmetic_prompts(200, seed=0, difficulty=1, split="train")
    correct = [arithmetic_reward(r["rejected"][0]["content"], p.metadata)["correct"] for r, p in zip(rows, records)]
    same_format = [r["rejection"] in ("wrong_near", "wrong_operation") for r in rows]
    assert sum(c == 0.0 for c in correct) / len(rows) == 0.9  # 18 of every 20 rejected replies are wrong
    assert sum(same_format) / len(rows) == 0.5  # and half of all pairs differ in nothing but the value


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_train_and_held_out_rows_are_disjoint_by_expression(difficulty: int) -> None:
    def expressions(rows: list[dict], user: str) -> set[str]:
        return {_expression(row[user][0]) for row in rows}

    for build, user in ((arithmetic_sft_rows, "messages"), (arithmetic_preference_rows, "prompt")):
        train = expressions(build(300, seed=0, difficulty=difficulty, split="train"), user)
        held_out = expressions(build(100, seed=0, difficulty=difficulty, split="held_out"), user)
        assert train and held_out and not train & held_out
        assert not any(map(is_held_out, train)) and all(map(is_held_out, held_out))


def test_rows_are_deterministic_and_prefix_stable() -> None:
    for build in (arithmetic_sft_rows, arithmetic_preference_rows):
        rows = build(60, seed=3, difficulty=3)
        assert rows == build(60, seed=3, difficulty=3)
        assert rows[:25] == build(25, seed=3, difficulty=3)
        assert rows != build(60, seed=4, difficulty=3)
        assert build(10, seed=3, difficulty=3, split="held_out") == build(10, seed=3, difficulty=3, split="held_out")


def test_pinned_rows() -> None:
    # The first rows of seed 0, level 1: what the shipped files start with (a change here changes every stage's data).
    assert arithmetic_sft_rows(2, seed=0, difficulty=1)[0]["messages"] == [
        {"role": "user", "content": "What is 3 + 2? Put the final answer after '####'."},
        {"role": "assistant", "content": "3 + 2 = 5\n#### 5"},
    ]
    first = arithmetic_preference_rows(1, seed=0, difficulty=1)[0]
    assert first["rejection"] == "wrong_operation"
    assert (first["chosen"][0]["content"], first["rejected"][0]["content"]) == (
        "3 + 2 equals 5.\n#### 5",
        "3 + 2 equals 1.\n#### 1",
    )


def test_unknown_kind_and_bad_arguments_say_what_to_change() -> None:
    with pytest.raises(KeyError, match="unknown rejection kind 'typo'.*wrong_near"):
        rejected_reply("typo", "1 + 2", 3, 1, random.Random(0))
    with pytest.raises(ValueError, match="split"):
        arithmetic_sft_rows(1, seed=0, difficulty=1, split="test")
    with pytest.raises(ValueError, match="difficulty"):
        arithmetic_preference_rows(1, seed=0, difficulty=9)


def test_the_command_writes_the_four_files_in_trl_shape(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(tmp_path / "data"), "--n", "30", "--n-eval", "10", "--difficulty", "2"]) == 0
    written = {p.name: [json.loads(line) for line in p.read_text().splitlines()] for p in (tmp_path / "data").iterdir()}
    assert written == {
        "sft_train.jsonl": arithmetic_sft_rows(30, seed=0, difficulty=2, split="train"),
        "sft_eval.jsonl": arithmetic_sft_rows(10, seed=0, difficulty=2, split="held_out"),
        "pairs_train.jsonl": arithmetic_preference_rows(30, seed=0, difficulty=2, split="train"),
        "pairs_eval.jsonl": arithmetic_preference_rows(10, seed=0, difficulty=2, split="held_out"),
    }
    assert len(capsys.readouterr().out.splitlines()) == 4
    with pytest.raises(SystemExit):
        main([str(tmp_path / "other"), "--difficulty", "7"])
