"""env.shots: worked examples before each arithmetic question, in training prompts and in the eval sets alike."""

import pytest

from common.config import load_config
from common.eval_metrics import answer_verdicts
from common.eval_sets import eval_set
from common.tasks import MAX_SHOTS, WORKED_EXAMPLES, arithmetic_prompts, evaluate_expression, is_held_out


def test_worked_examples_are_right_and_never_held_out():
    for expression, answer in WORKED_EXAMPLES:
        assert evaluate_expression(expression) == answer
        assert not is_held_out(expression)  # a held-out answer shown in the prompt would leak into evaluation


def test_shots_put_examples_before_the_question_and_keep_the_records():
    plain = arithmetic_prompts(20, seed=3, difficulty=1, split="train")
    shot = arithmetic_prompts(20, seed=3, difficulty=1, split="train", shots=2)
    for a, b in zip(plain, shot):
        assert a.metadata == b.metadata  # same questions, same order: only the chat grows
        assert [m["role"] for m in b.messages] == ["user", "assistant", "user", "assistant", "user"]
        assert b.messages[-1] == a.messages[0]
        for turn, (expression, answer) in zip(b.messages[1::2], WORKED_EXAMPLES):
            assert answer_verdicts(turn["content"], answer) == (True, True)  # the example shows the marker format
        assert b.messages[0]["content"] == a.messages[0]["content"].replace(
            a.metadata["expression"], WORKED_EXAMPLES[0][0]
        )


def test_eval_sets_ask_as_training_asks():
    for name in ("arithmetic", "arithmetic-d2", "arithmetic-reworded"):
        plain, shot = eval_set(name, limit=5).records, eval_set(name, limit=5, shots=1).records
        assert [r.metadata for r in plain] == [r.metadata for r in shot]
        assert all(len(r.messages) == 1 for r in plain) and all(len(r.messages) == 3 for r in shot)
        assert all(r.messages[-1] == p.messages[0] for r, p in zip(shot, plain))


def test_shots_out_of_range_are_refused_with_the_limit():
    with pytest.raises(ValueError, match=f"0..{MAX_SHOTS}"):
        arithmetic_prompts(1, seed=0, difficulty=1, shots=MAX_SHOTS + 1)
    assert load_config("examples/demo.toml", ["--env.shots", str(MAX_SHOTS)]).env.shots == MAX_SHOTS
    with pytest.raises(Exception, match="env.shots"):  # the config's bound is MAX_SHOTS too
        load_config("examples/demo.toml", ["--env.shots", str(MAX_SHOTS + 1)])
