"""The embedded arithmetic task, the reward parser, reward plug-ins, user datasets, prompt rendering.

.venv/bin/python -m pytest tests/common/test_tasks.py -q
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.tasks import (
    DIFFICULTIES,
    PromptRecord,
    arithmetic_prompts,
    arithmetic_reward,
    is_held_out,
    load_prompts,
    parse_answer,
    read_rows,
    render_prompt,
    resolve_reward_fn,
    total_reward,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


# --------------------------------------------------------------------------------------- reward


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("3 + 4 = 7\n#### 7", 7, {"correct": 1.0, "format": 0.1}),  # correct, formatted
        ("#### 3+4 = 7", 7, {"correct": 1.0, "format": 0.1}),  # SmolLM2's habit: the equation after the marker
        ("#### 7.", 7, {"correct": 1.0, "format": 0.1}),  # trailing punctuation
        ("#### 8", 7, {"correct": 0.0, "format": 0.1}),  # format only
        ("The answer is 7.", 7, {"correct": 1.0, "format": 0.0}),  # no marker: the last number
        ("3 + 4 = 8", 7, {"correct": 0.0, "format": 0.0}),  # wrong
        ("I cannot add numbers.", 7, {"correct": 0.0, "format": 0.0}),  # no answer at all
        ("", 7, {"correct": 0.0, "format": 0.0}),
        ("#### -12", -12, {"correct": 1.0, "format": 0.1}),  # negative
        ("#### \u221212", -12, {"correct": 1.0, "format": 0.1}),  # unicode minus
        ("5 - 17 = -12", -12, {"correct": 1.0, "format": 0.0}),
        ("#### 1,234", 1234, {"correct": 1.0, "format": 0.1}),  # thousands comma
        ("#### 7.0", 7, {"correct": 1.0, "format": 0.1}),
        ("#### 7.5", 7, {"correct": 0.0, "format": 0.1}),
        ("#### 7\n\nHope that helps with your 2 questions!", 7, {"correct": 1.0, "format": 0.1}),  # distractor after
        ("7 apples and 3 pears: 10 fruits", 7, {"correct": 0.0, "format": 0.0}),  # distractor last
        ("first #### 9, then #### 7", 7, {"correct": 1.0, "format": 0.1}),  # the last marker counts
        ("#### seven\nso 7", 7, {"correct": 1.0, "format": 0.0}),  # marker without a number: fallback
        ("#### 7", "7", {"correct": 1.0, "format": 0.1}),  # answer stored as a string
        ("#### 1234", "1,234", {"correct": 1.0, "format": 0.1}),
    ],
)
def test_arithmetic_reward_cases(completion: str, answer: int | str, expected: dict[str, float]) -> None:
    assert arithmetic_reward(completion, {"answer": answer}) == expected


def test_format_weight_is_a_keyword() -> None:
    assert arithmetic_reward("#### 1", {"answer": 2}, format_weight=0.0) == {"correct": 0.0, "format": 0.0}
    assert arithmetic_reward("#### 2", {"answer": 2}, format_weight=0.5) == {"correct": 1.0, "format": 0.5}


def test_reward_metadata_errors() -> None:
    with pytest.raises(KeyError, match="answer"):
        arithmetic_reward("#### 1", {"expression": "1"})
    with pytest.raises(ValueError, match="not a number"):
        arithmetic_reward("#### 1", {"answer": "one"})


@given(st.integers(-(10**9), 10**9), st.sampled_from(["{:d}", "{:,d}"]), st.sampled_from(["", ".", "!", " apples"]))
def test_parse_answer_reads_any_integer(value: int, form: str, tail: str) -> None:
    text = f"Let me think. 2 + 2 = 4\n#### {form.format(value)}{tail}\nBye 99"
    assert parse_answer(text) == (value, True)


def test_reward_of_true_answers_is_full() -> None:
    for difficulty in DIFFICULTIES:
        for record in arithmetic_prompts(50, seed=3, difficulty=difficulty):
            scalar, _ = total_reward(arithmetic_reward(f"#### {record.metadata['answer']}", record.metadata))
            assert scalar == pytest.approx(1.1)


# ------------------------------------------------------------------------------- arithmetic prompts


def test_arithmetic_prompts_are_reproducible() -> None:
    a = arithmetic_prompts(100, seed=7, difficulty=2)
    assert a == arithmetic_prompts(100, seed=7, difficulty=2)
    assert a[:10] == arithmetic_prompts(10, seed=7, difficulty=2)  # prefix-stable
    assert a != arithmetic_prompts(100, seed=8, difficulty=2)
    assert [r.prompt_id for r in a] == list(range(100))
    assert len({r.metadata["expression"] for r in a}) > 50


def test_arithmetic_prompt_shape() -> None:
    record = arithmetic_prompts(1, seed=0, difficulty=1)[0]
    expression = record.metadata["expression"]
    assert record.messages == [{"role": "user", "content": f"What is {expression}? Put the final answer after '####'."}]
    assert set(record.metadata) == {"answer", "expression", "difficulty"}
    assert record.metadata["answer"] == eval(expression)


@pytest.mark.parametrize(
    ("difficulty", "operands", "answers"),
    [(1, (0, 9), (0, 18)), (2, (10, 99), (0, 198)), (3, (2, 99), (-89, 891))],
)
def test_difficulty_ranges(difficulty: int, operands: tuple[int, int], answers: tuple[int, int]) -> None:
    records = arithmetic_prompts(500, seed=0, difficulty=difficulty)
    for record in records:
        expression, answer = str(record.metadata["expression"]), int(record.metadata["answer"])
        numbers = [int(tok) for tok in expression.split() if tok.isdigit()]
        assert len(numbers) == 2 and all(operands[0] <= n <= operands[1] for n in numbers), expression
        assert answers[0] <= answer <= answers[1] and answer == eval(expression)
    if difficulty == 3:
        assert {"+", "-", "*"} <= {tok for r in records for tok in str(r.metadata["expression"]).split()}


def test_harder_levels_have_more_operands() -> None:
    for difficulty, count in [(4, 3), (5, 5)]:
        for record in arithmetic_prompts(200, seed=0, difficulty=difficulty):
            expression = str(record.metadata["expression"])
            assert len([t for t in expression.replace("(", " ").replace(")", " ").split() if t.isdigit()]) == count
            assert record.metadata["answer"] == eval(expression)


def test_arithmetic_prompts_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="difficulty"):
        arithmetic_prompts(1, seed=0, difficulty=6)
    with pytest.raises(ValueError, match="num_prompts"):
        arithmetic_prompts(-1, seed=0, difficulty=1)
    with pytest.raises(ValueError, match="split"):
        arithmetic_prompts(1, seed=0, difficulty=1, split="test")


def test_split_all_keeps_the_records_of_before_the_split() -> None:
    # Pinned from the code before `split` existed: the default draws the same expressions (and ids) as then.
    pinned = {
        1: ["3 + 2", "9 + 1", "5 + 8"],
        2: ["64 - 34", "63 + 76", "15 + 42"],
        3: ["30 - 88", "95 - 23", "87 - 91"],
        4: ["96 - 6 + 92", "42 - 72 - 48", "82 - 46 + 27"],
        5: ["(17 + 10) * 4 + 64 + 72", "(69 - 71) * 5 + 93 - 68", "(2 + 13) * 7 - 79 + 28"],
    }
    for difficulty, expressions in pinned.items():
        records = arithmetic_prompts(3, seed=0, difficulty=difficulty)
        assert [r.metadata["expression"] for r in records] == expressions
        assert records == arithmetic_prompts(3, seed=0, difficulty=difficulty, split="all")
    assert [r.metadata["answer"] for r in arithmetic_prompts(3, seed=0, difficulty=3)] == [-58, 72, -4]
    expressions = [r.metadata["expression"] for r in arithmetic_prompts(5, seed=7, difficulty=2)]
    assert expressions == ["60 - 19", "18 + 42", "24 + 21", "94 - 31", "98 - 10"]


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_train_and_held_out_splits_are_disjoint_and_non_empty(difficulty: int) -> None:
    train = arithmetic_prompts(400, seed=0, difficulty=difficulty, split="train")
    held_out = arithmetic_prompts(100, seed=1, difficulty=difficulty, split="held_out")
    train_expressions = {r.metadata["expression"] for r in train}
    held_out_expressions = {r.metadata["expression"] for r in held_out}
    assert train_expressions and held_out_expressions
    assert not train_expressions & held_out_expressions
    assert not any(is_held_out(e) for e in train_expressions) and all(map(is_held_out, held_out_expressions))
    assert [r.prompt_id for r in train] == list(range(400))
    # A split is the `all` stream with the other side's records taken out.
    everything = [r.metadata["expression"] for r in arithmetic_prompts(600, seed=0, difficulty=difficulty)]
    assert [r.metadata["expression"] for r in train] == [e for e in everything if not is_held_out(e)][:400]


def test_splits_are_reproducible_and_prefix_stable() -> None:
    for split in ("train", "held_out"):
        a = arithmetic_prompts(60, seed=4, difficulty=2, split=split)
        assert a == arithmetic_prompts(60, seed=4, difficulty=2, split=split)
        assert a[:7] == arithmetic_prompts(7, seed=4, difficulty=2, split=split)


def test_held_out_share_per_level() -> None:
    level_1 = [f"{a} + {b}" for a in range(10) for b in range(10)]
    assert sum(map(is_held_out, level_1)) == 19  # of 100: the number the docstrings state
    for difficulty in DIFFICULTIES[1:]:
        expressions = {r.metadata["expression"] for r in arithmetic_prompts(5000, seed=0, difficulty=difficulty)}
        share = sum(map(is_held_out, expressions)) / len(expressions)
        # ~4,000+ distinct expressions: a binomial share's standard deviation is sqrt(0.2 * 0.8 / 4000) ~ 0.0063,
        # so 0.2 +- 0.03 is ~5 standard deviations (the hash is fixed, so this never flakes: it passes or fails).
        assert share == pytest.approx(0.2, abs=0.03), difficulty


def test_held_out_ignores_spacing_and_is_stable() -> None:
    assert is_held_out("9 + 1") and is_held_out(" 9  +   1 ") and not is_held_out("1 + 9")


def test_prompt_record_crosses_the_wire() -> None:
    record = arithmetic_prompts(1, seed=0, difficulty=4)[0]
    wire = msgpack.unpackb(msgpack.packb(record.to_dict()))
    assert PromptRecord.from_dict(wire) == record
    with pytest.raises(ValueError, match=r"metadata\['xs'\]"):
        PromptRecord(prompt_id=0, messages=[{"role": "user", "content": "hi"}], metadata={"xs": [1, 2]})
    with pytest.raises(ValueError, match="non-empty"):
        PromptRecord(prompt_id=0, messages=[])


# ------------------------------------------------------------------------------- reward plug-ins


def test_resolve_reward_fn_and_total(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_reward_fn("common.tasks:arithmetic_reward") is arithmetic_reward
    (tmp_path / "my_rewards_ok.py").write_text(
        "def length(completion, metadata):\n    return len(completion) / 10\n"
        "class Scorer:\n    @staticmethod\n    def score(completion, metadata):\n        return {'a': 1, 'b': 0.5}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert total_reward(resolve_reward_fn("my_rewards_ok:length")("abcde", {})) == (0.5, {"reward": 0.5})
    assert total_reward(resolve_reward_fn("my_rewards_ok:Scorer.score")("", {})) == (1.5, {"a": 1.0, "b": 0.5})


def test_resolve_reward_fn_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards_broken.py").write_text("import a_dependency_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="'no_colon'"):
        resolve_reward_fn("no_colon")
    with pytest.raises(ImportError, match="'nonexistent_pkg_xyz.rewards:f'.*no module named 'nonexistent_pkg_xyz'"):
        resolve_reward_fn("nonexistent_pkg_xyz.rewards:f")
    with pytest.raises(ImportError, match="'my_rewards_broken:f'.*importing 'my_rewards_broken' failed"):
        resolve_reward_fn("my_rewards_broken:f")
    with pytest.raises(AttributeError, match="'common.tasks:nope'"):
        resolve_reward_fn("common.tasks:nope")
    with pytest.raises(TypeError, match="'common.tasks:ANSWER_MARKER'.*not a callable"):
        resolve_reward_fn("common.tasks:ANSWER_MARKER")
    sys.modules.pop("my_rewards_broken", None)


def test_total_reward_forms() -> None:
    assert total_reward(1) == (1.0, {"reward": 1.0})
    assert total_reward(np.float32(0.25)) == (0.25, {"reward": 0.25})
    assert total_reward({"correct": True, "format": 0.1}) == (pytest.approx(1.1), {"correct": 1.0, "format": 0.1})
    with pytest.raises(TypeError, match="str"):
        total_reward("1.0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="component 'x'"):
        total_reward({"x": None})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="finite"):
        total_reward(float("nan"))
    with pytest.raises(ValueError, match="empty"):
        total_reward({})


# ---------------------------------------------------------------------------------- user datasets


def test_load_prompts_jsonl(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "data.jsonl",
        [
            {"prompt": "What is 1 + 1?", "answer": 2, "source": "hand", "skip": None},
            "",
            {
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
                "answer": "4",
            },
            {"prompt": "third", "answer": 3.5, "hard": True},
        ],
    )
    records = load_prompts(str(path))
    assert [r.prompt_id for r in records] == [0, 1, 2]
    assert records[0].messages == [{"role": "user", "content": "What is 1 + 1?"}]
    assert records[0].metadata == {"answer": 2, "source": "hand"}  # the null field is left out
    assert records[1].messages[0] == {"role": "system", "content": "Be brief."}
    assert records[2].metadata == {"answer": 3.5, "hard": True}
    assert load_prompts(str(path), limit=2) == records[:2]
    assert arithmetic_reward("#### 4", records[1].metadata)["correct"] == 1.0


def test_load_prompts_custom_keys(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "q.jsonl", [{"question": "Why?", "prompt": "kept as metadata"}])
    (record,) = load_prompts(str(path), prompt_key="question")
    assert record.messages == [{"role": "user", "content": "Why?"}]
    assert record.metadata == {"prompt": "kept as metadata"}


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ('{"prompt": "unterminated', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"answer": 1}, r"no prompt: the row has no 'prompt'.*keys are \['answer'\].*env.prompt_key"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "both 'prompt' and 'messages'"),
        ({"prompt": 5}, "'prompt' must be a string"),
        ({"messages": [{"role": "user"}]}, r"messages\[0\]"),
        ({"prompt": [1, 2]}, "'prompt' must be a string or a list of"),  # a list field elsewhere is JSON metadata
    ],
)
def test_load_prompts_malformed_row_names_file_and_line(tmp_path: Path, bad_row: object, message: str) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, "", bad_row])
    with pytest.raises(ValueError, match=rf"bad\.jsonl, line 3: .*{message}"):
        load_prompts(str(path))


def test_load_prompts_source_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    (tmp_path / "data.csv").write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match=r"\.jsonl or \.parquet"):
        load_prompts(str(tmp_path / "data.csv"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        load_prompts(str(tmp_path / "empty.jsonl"))


def test_read_rows_names_each_row_and_checks_the_source_at_once(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "rows.jsonl", [{"a": 1}, "", {"b": [2]}])
    assert list(read_rows(str(path))) == [(f"{path}, line 1", {"a": 1}), (f"{path}, line 3", {"b": [2]})]
    with pytest.raises(FileNotFoundError, match="sft source '.*missing.jsonl' does not exist"):
        read_rows(str(tmp_path / "missing.jsonl"), what="sft source")  # raised by the call, not the first row
    (tmp_path / "data.csv").write_text("a\n1\n")
    with pytest.raises(ValueError, match=r"data source '.*data.csv': expected a \.jsonl or \.parquet"):
        read_rows(str(tmp_path / "data.csv"))


def test_optional_readers_say_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "data.parquet").write_bytes(b"PAR1")
    (tmp_path / "saved").mkdir()
    for name in ("pyarrow", "pyarrow.parquet", "datasets"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_prompts(str(tmp_path / "data.parquet"))
    with pytest.raises(ImportError, match="pip install datasets"):
        load_prompts(str(tmp_path / "saved"))


def test_load_prompts_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    chat = [{"role": "user", "content": "c"}]
    table = pa.table({"prompt": ["a", "b", None], "answer": [1, 2, 3], "messages": [None, None, chat]})
    pq.write_table(table, tmp_path / "data.parquet")
    records = load_prompts(str(tmp_path / "data.parquet"))
    assert [r.messages[0]["content"] for r in records] == ["a", "b", "c"]
    assert [r.metadata for r in records] == [{"answer": 1}, {"answer": 2}, {"answer": 3}]


def test_load_prompts_datasets_folder(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    pa = pytest.importorskip("pyarrow")
    from datasets.table import InMemoryTable

    def dataset(columns: dict[str, list[object]]) -> object:
        # An explicit fingerprint skips datasets' dill hashing, which breaks on some pyarrow releases.
        return datasets.Dataset(InMemoryTable(pa.table(columns)), fingerprint="test")

    dataset({"prompt": ["a", "b"], "answer": [1, 2]}).save_to_disk(str(tmp_path / "ds"))
    records = load_prompts(str(tmp_path / "ds"), limit=1)
    assert records == [PromptRecord(0, [{"role": "user", "content": "a"}], {"answer": 1})]
    datasets.DatasetDict({"train": dataset({"prompt": ["a"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"splits \['train'\]"):
        load_prompts(str(tmp_path / "dd"))
    assert len(load_prompts(str(tmp_path / "dd" / "train"))) == 1


# --------------------------------------------------------------------------------------- rendering


def test_render_prompt(smollm2_tokenizer: object) -> None:
    record = arithmetic_prompts(1, seed=0, difficulty=1)[0]
    ids = render_prompt(smollm2_tokenizer, record)
    assert all(isinstance(i, int) for i in ids) and ids[0] == 1  # <|im_start|>
    text = smollm2_tokenizer.decode(ids)  # type: ignore[attr-defined]
    assert text.endswith(f"<|im_start|>user\n{record.messages[0]['content']}<|im_end|>\n<|im_start|>assistant\n")
    with_system = PromptRecord(1, [{"role": "system", "content": "S"}, *record.messages], record.metadata)
    rendered = smollm2_tokenizer.decode(render_prompt(smollm2_tokenizer, with_system))  # type: ignore[attr-defined]
    assert rendered.startswith("<|im_start|>system\nS<|im_end|>\n")


def test_render_prompt_needs_a_chat_template() -> None:
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        render_prompt(NoTemplate(), arithmetic_prompts(1, seed=0, difficulty=1)[0])
