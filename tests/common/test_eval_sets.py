"""The evaluation sets: held out from training, distinct, stable, capped; names checked before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.eval_sets import REWORDED_INSTRUCTION, eval_set, parse_set_names
from common.tasks import ANSWER_MARKER, arithmetic_prompts, is_held_out


@pytest.mark.parametrize(("name", "difficulty"), [("arithmetic", 1), ("arithmetic-d2", 2)])
def test_arithmetic_sets_are_distinct_held_out_expressions(name: str, difficulty: int) -> None:
    records = eval_set(name, limit=50).records
    expressions = [r.metadata["expression"] for r in records]
    assert len(set(expressions)) == len(expressions)
    assert all(is_held_out(e) for e in expressions)
    assert all(r.metadata["difficulty"] == difficulty for r in records)
    assert [r.prompt_id for r in records] == list(range(len(records)))
    trained = {r.metadata["expression"] for r in arithmetic_prompts(2000, seed=0, difficulty=difficulty, split="train")}
    assert not trained & set(expressions)


def test_level_1_has_its_19_held_out_expressions_whatever_the_cap() -> None:
    assert len(eval_set("arithmetic").records) == 19  # common.tasks: 19 of level 1's 100 expressions are held out
    assert len(eval_set("arithmetic-d2").records) == 200  # the default cap
    assert eval_set("arithmetic", limit=4).records == eval_set("arithmetic").records[:4]  # a prefix


def test_reworded_set_asks_for_the_marker_in_other_words() -> None:
    plain, reworded = eval_set("arithmetic").records, eval_set("arithmetic-reworded").records
    assert [r.metadata for r in plain] == [r.metadata for r in reworded]
    for a, b in zip(plain, reworded, strict=True):
        assert a.messages[0]["content"] != b.messages[0]["content"]
        assert ANSWER_MARKER in b.messages[0]["content"] and REWORDED_INSTRUCTION in b.messages[0]["content"]


def test_file_sets_read_prompts_and_keep_the_first_rows(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": i}) + "\n" for i in range(5)))
    records = eval_set(f"file:{path}", limit=3).records
    assert [r.messages[0]["content"] for r in records] == ["q0", "q1", "q2"]
    assert [r.metadata["answer"] for r in records] == [0, 1, 2]


def test_set_names_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "x"}\n')
    assert parse_set_names(f" arithmetic ,file:{path},arithmetic") == ["arithmetic", f"file:{path}"]
    with pytest.raises(ValueError, match="unknown evaluation set 'arithmetc'; the sets: arithmetic, arithmetic-d2"):
        parse_set_names("arithmetc")
    with pytest.raises(ValueError, match="does not exist"):
        parse_set_names(f"file:{tmp_path / 'missing.jsonl'}")
    with pytest.raises(ValueError, match="no evaluation set"):
        parse_set_names(" , ")
    with pytest.raises(ValueError, match="at least 1 prompt"):
        eval_set("arithmetic", limit=0)


def test_a_config_loads_with_a_file_set_absent_here_and_the_run_check_names_it(tmp_path):
    """A config written for other machines loads anywhere; `tandem run`/the buffer check the file where they run."""
    from common.config import load_config
    from launch.config_checks import missing_paths

    path = tmp_path / "run.toml"
    path.write_text(f'[eval]\nsets = ["arithmetic", "file:{tmp_path / "absent.jsonl"}"]\n')
    config = load_config(path, [])
    problems = [p for p in missing_paths(config, "buffer") if p.startswith("eval.")]
    assert problems == [
        (
            f"eval.sets[1]: evaluation set 'file:{tmp_path / 'absent.jsonl'}': "
            f"'{tmp_path / 'absent.jsonl'}' does not exist on this machine"
        )
    ]
