"""Named evaluation sets: held-out arithmetic, transfer sets, held-out word problems, and any prompt file.

    from common.eval_sets import eval_set, parse_set_names
    for name in parse_set_names("arithmetic,arithmetic-d2,file:data/test.jsonl"):
        prompts = eval_set(name, limit=200).records      # PromptRecords, prompt_id = index in the set

The sets (`SETS`; `tandem eval --sets`, and the names an `[eval]` config section can list):
  arithmetic           level-1 arithmetic (a + b, single digits) from the held-out split (`common.tasks.is_held_out`),
                       which training never draws from (env.split = "train"): measures the task on unseen questions
  arithmetic-d2        level-2 arithmetic (two-digit + and -), held out: transfer to harder questions
  arithmetic-reworded  the `arithmetic` questions with the instruction reworded (it still asks for the `####`
                       marker): transfer to a prompt the model was not trained on
  word_problems        level-1 (WORD_PROBLEMS_LEVEL) word problems (common.word_problems), held out: the
                       GSM8K-shaped task on unseen questions; metadata `answer` is a worked solution ending in
                       `#### n`, and strict/lenient accuracy compare with that n (common.eval_metrics)
  word_problems-d2     level-2 word problems (one addition or subtraction, numbers to 20), held out: the task of
                       benchmarks/time_to_accuracy's workloads (the embedded model leaves headroom there)
  file:PATH            the prompts of a .jsonl / .parquet / `datasets` folder (`common.tasks.load_prompts`), scored
                       by the config's env.reward_fn; rows with an `answer` field get strict/lenient accuracy too
An arithmetic set holds each expression once, in the order the held-out stream first draws it: level 1 has only 19
held-out expressions, so `arithmetic` has 19 prompts whatever the limit; level 2 has thousands (the limit applies).
Sets are the same on every machine and for every run seed (EVAL_SEED is fixed), so evaluations compare.
No torch and no tokenizer here: a config can name sets, and a launcher check them, cheaply.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.prompt_sources import RowMapping, load_source
from common.tasks import ANSWER_MARKER, PromptRecord, arithmetic_messages, arithmetic_prompts
from common.word_problems import word_problem_prompts

EVAL_SEED = 0
MAX_SET_PROMPTS = 200  # the default cap on prompts per set
FILE_PREFIX = "file:"
REWORDED_INSTRUCTION = f"End your reply with '{ANSWER_MARKER}' followed by the final answer."
_DRAWN_PER_PROMPT = 10  # held-out prompts drawn per distinct one wanted (repeats are dropped)
_MIN_DRAWN = 2000  # level 1: 19 distinct held-out expressions, each ~1/19 of the draws; 2000 draws find them all
WORD_PROBLEMS_LEVEL = 1  # the level examples/word_problems.toml trains on (common.word_problems: the measured headroom)


@dataclass(frozen=True)
class EvalSet:
    """One evaluation set: its name (as written in --sets), what it measures, its prompts (prompt_id = index)."""

    name: str
    description: str
    records: list[PromptRecord]


def _distinct_held_out(difficulty: int, limit: int, shots: int) -> list[PromptRecord]:
    """The first `limit` distinct held-out expressions of a level, renumbered 0.. (the stream is prefix-stable, so
    a smaller limit gives a prefix of a larger one), each with `shots` worked examples before it."""
    drawn = arithmetic_prompts(
        max(_MIN_DRAWN, limit * _DRAWN_PER_PROMPT), seed=EVAL_SEED, difficulty=difficulty, split="held_out", shots=shots
    )
    return _first_distinct(drawn, "expression", limit)


def _distinct_word_problems(difficulty: int, limit: int, shots: int) -> list[PromptRecord]:
    """The first `limit` distinct held-out questions of a word-problem level, renumbered 0.. (prefix-stable like
    `_distinct_held_out`; thousands of distinct held-out questions per level, so repeats are rare)."""
    drawn = word_problem_prompts(
        limit * _DRAWN_PER_PROMPT, seed=EVAL_SEED, difficulty=difficulty, split="held_out", shots=shots
    )
    return _first_distinct(drawn, "question", limit)


def _first_distinct(drawn: list[PromptRecord], key: str, limit: int) -> list[PromptRecord]:
    """The first `limit` records of `drawn` whose `metadata[key]` was not seen before, renumbered 0.. in order."""
    seen: dict[str, PromptRecord] = {}
    for record in drawn:
        value = str(record.metadata[key])
        if value not in seen:
            seen[value] = PromptRecord(len(seen), record.messages, dict(record.metadata))
            if len(seen) == limit:
                break
    return list(seen.values())


def _reworded(record: PromptRecord, shots: int) -> PromptRecord:
    """The question (and its worked examples) asked with REWORDED_INSTRUCTION instead of the task's own."""
    ask = "Calculate {expression}. " + REWORDED_INSTRUCTION
    messages = arithmetic_messages(str(record.metadata["expression"]), shots=shots, ask=ask)
    return PromptRecord(record.prompt_id, messages, dict(record.metadata))


_BUILTIN: dict[str, tuple[str, Callable[[int, int], list[PromptRecord]]]] = {
    "arithmetic": ("held-out level-1 arithmetic", lambda limit, shots: _distinct_held_out(1, limit, shots)),
    "arithmetic-d2": (
        "held-out level-2 arithmetic (transfer)",
        lambda limit, shots: _distinct_held_out(2, limit, shots),
    ),
    "arithmetic-reworded": (
        "held-out level-1 arithmetic, reworded instruction (transfer)",
        lambda limit, shots: [_reworded(r, shots) for r in _distinct_held_out(1, limit, 0)],
    ),
    "word_problems": (
        f"held-out level-{WORD_PROBLEMS_LEVEL} word problems (GSM8K-shaped)",
        lambda limit, shots: _distinct_word_problems(WORD_PROBLEMS_LEVEL, limit, shots),
    ),
    "word_problems-d2": (
        "held-out level-2 word problems (addition or subtraction, numbers to 20)",
        lambda limit, shots: _distinct_word_problems(2, limit, shots),
    ),
}
SETS = (*_BUILTIN, f"{FILE_PREFIX}PATH")


def parse_set_names(text: str) -> list[str]:
    """The set names of a comma-separated list (`arithmetic,file:x.jsonl`), in order, without repeats, each
    checked: a built-in name, or `file:` and a path that exists. Raises ValueError naming the bad entry and the
    sets there are."""
    names = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if not names:
        raise ValueError(f"no evaluation set named in {text!r}; the sets: {', '.join(SETS)}")
    for name in names:
        check_set_name(name)
    return names


def check_set_name(name: str, paths: bool = True) -> None:
    """Raise ValueError, saying what to write, unless `name` is a built-in set or `file:` and a path, which must
    exist when `paths` (a config is loaded without it: its files are checked where the buffer runs, by
    launch/config_checks.py, so a config for other machines loads anywhere)."""
    if name in _BUILTIN:
        return
    if name.startswith(FILE_PREFIX):
        path = Path(name[len(FILE_PREFIX) :]).expanduser()
        if paths and not path.exists():
            raise ValueError(f"evaluation set {name!r}: {str(path)!r} does not exist")
        return
    raise ValueError(f"unknown evaluation set {name!r}; the sets: {', '.join(SETS)}")


def set_label(name: str) -> str:
    """The name a set's metrics go under (`eval/<label>/<metric>`): a built-in set's own name; for `file:PATH`, the
    file's stem (`file:data/test.jsonl` -> `test`, a `datasets` folder's name), with anything but letters, digits,
    '_', '-' and '.' replaced by '_', so that a key holds no '/' or ':' (TensorBoard groups series by '/')."""
    if not name.startswith(FILE_PREFIX):
        return name
    path = Path(name[len(FILE_PREFIX) :].rstrip("/"))
    stem = path.stem if path.suffix else path.name
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem) or "file"


def eval_set(
    name: str,
    *,
    limit: int = MAX_SET_PROMPTS,
    shots: int = 0,
    prompt_key: str = "prompt",
    messages_key: str = "messages",
    mapping: RowMapping | None = None,
) -> EvalSet:
    """The set `name` (see the module docstring) with at most `limit` prompts (>= 1). An arithmetic or word-problem
    set puts `shots` worked examples before each question (`common.tasks.arithmetic_messages`,
    `common.word_problems.word_problem_messages`; pass the run's env.shots, so that it asks as training asked). A file set keeps its first `limit` rows (`prompt_key` / `messages_key` as in
    `common.tasks.load_prompts`). Raises ValueError for an unknown name or a bad limit, and what `load_prompts`
    raises for a bad file. `mapping` (the run's `common.prompt_sources.env_row_mapping`) reads a file set
    with the run's keys, template and system prompt instead of `prompt_key` / `messages_key` alone."""
    if limit < 1:
        raise ValueError(f"an evaluation set needs at least 1 prompt, got limit {limit}")
    check_set_name(name)
    if name in _BUILTIN:
        description, build = _BUILTIN[name]
        return EvalSet(name, description, build(limit, shots))
    source = name[len(FILE_PREFIX) :]
    if mapping is None:
        mapping = RowMapping(prompt_key=prompt_key, messages_key=messages_key)
    records = load_source(source, mapping, limit=limit)  # the run's column mapping: asked as training asked
    return EvalSet(name, f"prompts of {source}", records)
