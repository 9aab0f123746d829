"""Prompts and verifiable rewards: the embedded arithmetic task, user datasets, reward-function plug-ins.

    from common.tasks import arithmetic_prompts, arithmetic_reward, render_prompt, total_reward
    records = arithmetic_prompts(1024, seed=0, difficulty=1)
    token_ids = render_prompt(tokenizer, records[0])          # what the generator feeds vLLM
    scalar, components = total_reward(arithmetic_reward(completion, records[0].metadata))

A `PromptRecord` crosses process boundaries as plain fields (`to_dict` / `from_dict`); its `prompt_id` is its
row index in the dataset it came from, so the same source and arguments always give the same ids.
Importing this module is cheap: no torch, no tokenizer library; the optional dataset readers (pyarrow,
datasets) are imported only by the loaders that need them.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import inspect
import json
import math
import numbers
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from common.chat_format import TOKENIZER_OWN, ChatFormat
from common.plugins import resolve_callable

MetadataValue = str | int | float | bool
RewardFn = Callable[[str, Mapping[str, Any]], float | Mapping[str, float]]

ANSWER_MARKER = "####"
ARITHMETIC_INSTRUCTION = f"Put the final answer after '{ANSWER_MARKER}'."
DEFAULT_FORMAT_WEIGHT = 0.1
_SCALARS = (str, int, float, bool)


# ------------------------------------------------------------------------------------------ records


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a dataset.

    prompt_id: the row index in the dataset (0-based, counting only data rows): stable for a given source.
    messages:  the chat to complete, `[{"role": ..., "content": ...}, ...]`, non-empty, roles and contents
               strings; the generator renders it with the chat template and a generation prompt.
    metadata:  everything the reward needs (for arithmetic: `answer`, `expression`, `difficulty`), values
               scalars only (str, int, float, bool) so that they cross the wire as plain fields.
    Construction validates these shapes and raises ValueError naming the bad field.
    """

    prompt_id: int
    messages: list[dict[str, str]]
    metadata: dict[str, MetadataValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_id, int) or isinstance(self.prompt_id, bool) or self.prompt_id < 0:
            raise ValueError(f"prompt_id must be a non-negative int, got {self.prompt_id!r}")
        if not isinstance(self.messages, list) or not self.messages:
            raise ValueError(f"messages must be a non-empty list of chat messages, got {self.messages!r}")
        for i, message in enumerate(self.messages):
            if (
                not isinstance(message, dict)
                or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)
            ):
                raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content', got {message!r}")
        for key, value in self.metadata.items():
            if not isinstance(key, str) or not isinstance(value, _SCALARS):
                raise ValueError(
                    f"metadata[{key!r}] = {value!r}: metadata values must be str, int, float or bool "
                    "(encode structured values as a JSON string)"
                )

    def to_dict(self) -> dict[str, Any]:
        """Plain fields (copies), for msgpack/JSON."""
        return {
            "prompt_id": self.prompt_id,
            "messages": [dict(m) for m in self.messages],
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PromptRecord:
        """Inverse of `to_dict`; validates like the constructor."""
        return cls(
            prompt_id=data["prompt_id"],
            messages=[dict(m) for m in data["messages"]],
            metadata=dict(data.get("metadata", {})),
        )


class HasMessages(Protocol):
    """Anything carrying a chat: a PromptRecord, or the `common.types.PromptItem` a lease delivers."""

    @property
    def messages(self) -> list[dict[str, str]]: ...


def render_prompt(tokenizer: Any, record: HasMessages, chat: ChatFormat = TOKENIZER_OWN) -> list[int]:
    """The prompt token ids the generator samples from: `record.messages` through the chat template (`chat`,
    model.chat_template and its kwargs; default the tokenizer's own) with the assistant generation prompt appended
    (for SmolLM2: ChatML, ending `<|im_start|>assistant\\n`). `record` is a PromptRecord or anything with the same
    `messages` (e.g. a lease's `PromptItem`).

    Raises ValueError when there is no chat template (the tokenizer's own is asked for and it has none).
    """
    return chat.render_prompt(tokenizer, record.messages)


# ------------------------------------------------------------------------------------- arithmetic


def _level_1(rng: random.Random) -> str:
    return f"{rng.randint(0, 9)} + {rng.randint(0, 9)}"


def _level_2(rng: random.Random) -> str:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if rng.random() < 0.5:
        return f"{a} + {b}"
    return f"{max(a, b)} - {min(a, b)}"


def _level_3(rng: random.Random) -> str:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    kind = rng.randrange(3)
    if kind == 0:
        return f"{a} + {b}"
    if kind == 1:
        return f"{a} - {b}"
    return f"{a} * {rng.randint(2, 9)}"


def _level_4(rng: random.Random) -> str:
    a, b, c = (rng.randint(1, 99) for _ in range(3))
    op1, op2 = rng.choice("+-*"), rng.choice("+-")
    if op1 == "*":
        b = rng.randint(2, 9)
    return f"{a} {op1} {b} {op2} {c}"


def _level_5(rng: random.Random) -> str:
    a, b, c, d = (rng.randint(1, 99) for _ in range(4))
    return f"({a} {rng.choice('+-')} {b}) * {rng.randint(2, 9)} {rng.choice('+-')} {c} {rng.choice('+-')} {d}"


# difficulty -> expression sampler. Every answer is an integer.
#   1: single-digit addition, a + b with a, b in 0..9 (answers 0..18). The level SmolLM2-135M can learn on:
#      measured with vLLM (64 prompts x 8 samples, 128 tokens), mean reward 0.28 at temperature 1.0 (0.53 at 0.7),
#      57 of 64 groups with a reward spread, so GRPO has signal and ample headroom. Level 2 measured 0.04.
#   2: two-digit addition or subtraction (a, b in 10..99; subtraction never negative).
#   3: two-digit addition or subtraction (may be negative), or a two-digit number times a single digit.
#   4: three operands, `a op b op c`, op in + - * (at most one *, by a single digit), usual precedence.
#   5: four operands with parentheses: `(a ± b) * k ± c ± d`.
_LEVELS: dict[int, Callable[[random.Random], str]] = {1: _level_1, 2: _level_2, 3: _level_3, 4: _level_4, 5: _level_5}
DIFFICULTIES = tuple(sorted(_LEVELS))


_OPERATORS: dict[type, Callable[[int, int], int]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
}


def evaluate_expression(expression: str) -> int:
    """Value of an arithmetic expression: integers, + - *, parentheses, usual precedence (no `eval`).
    Raises ValueError for anything else (a name, a division, a float, a call)."""

    def value(node: ast.expr) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not an integer + - * expression: {expression!r}")

    return value(ast.parse(expression, mode="eval").body)


HELD_OUT_PERCENT = 20
SPLITS = ("train", "held_out", "all")


def is_held_out(expression: str) -> bool:
    """Whether an arithmetic expression belongs to the held-out split: a fixed ~20% (HELD_OUT_PERCENT) of the
    expressions of every level, chosen by SHA-256 of the expression text (whitespace runs folded to one space), so
    the split is the same on every machine, in every process and for every seed, and an expression that two levels
    share (`12 + 34` at levels 2 and 3) is on the same side in both. Level 1 has only 100 distinct expressions
    (a + b, a and b in 0..9): 19 of them are held out, 81 train (see `arithmetic_prompts`)."""
    text = " ".join(expression.split())
    digest = hashlib.sha256(f"tandem-held-out:{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELD_OUT_PERCENT


def _in_split(expression: str, split: str) -> bool:
    return split == "all" or is_held_out(expression) == (split == "held_out")


# Worked examples that `shots` > 0 puts before the question, as earlier turns of the chat: each shows the format the
# instruction asks for. All are train-split expressions (checked by tests/common), so no held-out answer is shown.
WORKED_EXAMPLES = (("2 + 3", 5), ("6 + 1", 7), ("5 + 4", 9))
MAX_SHOTS = len(WORKED_EXAMPLES)


def arithmetic_messages(
    expression: str, *, shots: int = 0, ask: str = "What is {expression}? " + ARITHMETIC_INSTRUCTION
) -> list[dict[str, str]]:
    """The chat of one question: `shots` worked examples (a user question and the assistant's `a + b = c` then
    `#### c`, from WORKED_EXAMPLES), then the question `ask` formatted with the expression. Raises ValueError for
    shots outside 0..MAX_SHOTS."""
    if not 0 <= shots <= MAX_SHOTS:
        raise ValueError(f"shots must be in 0..{MAX_SHOTS} (the worked examples there are), got {shots}")
    messages = []
    for example, answer in WORKED_EXAMPLES[:shots]:
        messages.append({"role": "user", "content": ask.format(expression=example)})
        messages.append({"role": "assistant", "content": f"{example} = {answer}\n{ANSWER_MARKER} {answer}"})
    return [*messages, {"role": "user", "content": ask.format(expression=expression)}]


def arithmetic_prompts(
    num_prompts: int, *, seed: int, difficulty: int, split: str = "all", shots: int = 0
) -> list[PromptRecord]:
    """`num_prompts` arithmetic questions of one difficulty level (see `_LEVELS` for the levels, 1..5).

    Each user message reads `What is <expression>? Put the final answer after '####'.`; with `shots` > 0, that many
    worked examples come first (`arithmetic_messages`: earlier turns that show the format). Metadata holds
    `answer` (int), `expression` (str) and `difficulty` (int). Reproducible: the same (seed, difficulty, split)
    gives the same records, and a shorter list is a prefix of a longer one. prompt_id = index in the list.

    split: `all` draws every expression (the records of before the split existed); `train` skips the expressions
    `is_held_out` picks, `held_out` keeps only those. Both walk the same random stream as `all` and drop what is on
    the other side, so a split's list is the `all` list with the other side's records taken out (ids renumbered).
    Expressions repeat within a list (levels are sampled with replacement), never across the two splits. At level 1
    only 100 expressions exist: the train split draws from 81 of them, the held-out split from the other 19, so a
    held-out evaluation of more than 19 prompts repeats questions (count distinct expressions when that matters),
    and a held-out `9 + 1` may have its mirror `1 + 9` in training (the split is by text, not by value).
    Raises ValueError for an unknown difficulty or split, or a negative count.
    """
    if difficulty not in _LEVELS:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    rng = random.Random(f"tandem-arithmetic:{seed}:{difficulty}")
    records: list[PromptRecord] = []
    while len(records) < num_prompts:
        expression = _LEVELS[difficulty](rng)
        if not _in_split(expression, split):
            continue
        records.append(
            PromptRecord(
                prompt_id=len(records),
                messages=arithmetic_messages(expression, shots=shots),
                metadata={
                    "answer": evaluate_expression(expression),
                    "expression": expression,
                    "difficulty": difficulty,
                },
            )
        )
    return records


# A number: optional minus (ASCII or U+2212), thousands groups with commas or plain digits, optional decimals.
# A dot not followed by a digit (sentence end) is not part of the number.
_NUMBER = re.compile(r"(?<!\d)[-\u2212]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def _to_number(text: str) -> float:
    return float(text.replace(",", "").replace("\u2212", "-"))


def parse_answer(completion: str) -> tuple[float | None, bool]:
    """(answer, formatted) read from a completion.

    With the marker `####`: the last number on the first non-blank line after the last marker
    (`#### 7`, `#### 3 + 4 = 7.` both give 7), formatted=True when that line has a number.
    Without it (or with no number on that line): the last number anywhere in the text, formatted=False;
    None when there is no number at all. Numbers may be negative (`-3`, `−3`), have thousands commas
    (`1,234`), decimals (`7.0`) and trailing punctuation (`7.`).
    """
    if ANSWER_MARKER in completion:
        after = completion.rsplit(ANSWER_MARKER, 1)[1]
        line = next((ln for ln in after.splitlines() if ln.strip()), "")
        numbers = _NUMBER.findall(line)
        if numbers:
            return _to_number(numbers[-1]), True
    numbers = _NUMBER.findall(completion)
    return (_to_number(numbers[-1]) if numbers else None), False


def arithmetic_reward(
    completion: str, metadata: Mapping[str, Any], *, format_weight: float = DEFAULT_FORMAT_WEIGHT
) -> dict[str, float]:
    """Verifiable reward: `{"correct": 1.0 | 0.0, "format": format_weight | 0.0}`; the scalar reward is the sum.

    correct: the answer `parse_answer` reads (after the marker, else the last number in the text) equals
    `metadata["answer"]` (an int, a float, a numeric string such as "1,234", or a worked solution whose last
    `####` is followed by the number, as GSM8K and common.word_problems write it). The fallback to the last
    number is deliberate: SmolLM2-135M rarely writes the marker at first (~5% of samples), so a marker-only
    rule would leave almost no signal to learn from, while the last number is right ~30% of the time.
    format: `format_weight` when the marker is followed by a number on its line, whether right or not.
    The default 0.1 is a shaping bonus: enough for GRPO to prefer the marker among equally (in)correct samples,
    small enough that a wrong answer in the right format never outscores a right one.
    Raises KeyError when metadata has no `answer`, ValueError when it is not a number.
    """
    if "answer" not in metadata:
        raise KeyError(f"arithmetic_reward needs metadata['answer'], got keys {sorted(metadata)}")
    expected = metadata["answer"]
    if isinstance(expected, str) and ANSWER_MARKER in expected:  # a worked solution ending in `#### n` (GSM8K)
        expected, formatted = parse_answer(expected)
        if not formatted:
            raise ValueError(f"metadata['answer'] = {metadata['answer']!r} has no number after its last '####'")
    elif isinstance(expected, str):
        matched = _NUMBER.fullmatch(expected.strip())
        if matched is None:
            raise ValueError(f"metadata['answer'] = {expected!r} is not a number")
        expected = _to_number(matched.group())
    answer, formatted = parse_answer(completion)
    correct = answer is not None and math.isclose(answer, float(expected), rel_tol=0.0, abs_tol=1e-9)
    return {"correct": 1.0 if correct else 0.0, "format": float(format_weight) if formatted else 0.0}


# ------------------------------------------------------------------------------- reward plug-ins


# Short names of the built-in reward functions (env.reward_fn = "math"): name -> (spec, the module the function
# needs at call time or "" for none, the pip extra that brings it).
BUILTIN_REWARD_FNS: dict[str, tuple[str, str, str]] = {
    "arithmetic": ("common.tasks:arithmetic_reward", "", ""),
    "math": ("common.math_reward:math_reward", "math_verify", "math"),
}


def builtin_reward_spec(name: str) -> str:
    """The `module:function` spec of a built-in reward function's short name (a spec with a colon is returned as
    it is). Raises ValueError for an unknown bare name, listing the built-ins."""
    if ":" in name:
        return name
    if name not in BUILTIN_REWARD_FNS:
        raise ValueError(
            f"reward function {name!r}: not a built-in name ({', '.join(sorted(BUILTIN_REWARD_FNS))}) and not "
            "'module.path:function'"
        )
    return BUILTIN_REWARD_FNS[name][0]


def resolve_reward_fn(spec: str, search_path: Sequence[str] = (), args: Mapping[str, Any] | None = None) -> RewardFn:
    """The callable named by `spec`: a built-in short name (`BUILTIN_REWARD_FNS`: "math", "arithmetic") or
    `"package.module:function"` (a dotted attribute path after the colon also works), imported from `search_path`
    (the resolved `env.plugin_paths`) first, then PYTHONPATH and the installed packages. With `args` (e.g.
    `env.reward_fn_args`), the function comes back with them bound as keyword arguments (functools.partial).

    The function is called as `fn(completion, metadata)` and returns a float or a mapping of named float
    components (see `total_reward`). Raises ValueError for a malformed spec or an unknown bare name (listing the
    built-ins), ImportError when the module cannot be imported (saying where it was searched) or a built-in's
    package is missing (saying what to pip install), AttributeError when it has no such attribute, TypeError when
    the attribute is not callable, ValueError naming the arguments of `args` the function does not accept (or
    whose values its `check_args(args)` attribute refuses, when it has one); every message names the spec.
    """
    builtin = BUILTIN_REWARD_FNS.get(spec)
    if builtin is not None and builtin[1] and importlib.util.find_spec(builtin[1]) is None:
        raise ImportError(
            f"reward function {spec!r} needs the {builtin[1]!r} package, which is not installed: "
            f"pip install 'tandem-rl[{builtin[2]}]'"
        )
    function = resolve_callable(
        builtin_reward_spec(spec), "reward function", "module.path:function", "a callable", search_path
    )
    if not args:
        return function
    _check_reward_args(function, spec, args)
    check_values = getattr(function, "check_args", None)  # a function's own check of the values (math_reward's)
    if callable(check_values):
        try:
            check_values(dict(args))
        except ValueError as error:
            raise ValueError(f"env.reward_fn_args: reward function {spec!r}: {error}") from None
    return functools.partial(function, **args)


def _check_reward_args(function: Callable[..., Any], spec: str, args: Mapping[str, Any]) -> None:
    """Raise ValueError naming the keys of `args` that `function` cannot take as keyword arguments after its
    `(completion, metadata)`: names it lacks (without **kwargs), positional-only ones, and the first two."""
    parameters = list(inspect.signature(function).parameters.values())
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    positional = [p for p in parameters if p.kind != inspect.Parameter.KEYWORD_ONLY][:2]
    accepted = {p.name for p in parameters if p.kind in keyword and p not in positional}
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)
    taken = {p.name for p in positional}
    refused = sorted(name for name in args if name in taken or not (name in accepted or takes_any))
    if refused:
        raise ValueError(
            f"env.reward_fn_args: reward function {spec!r} does not accept {', '.join(refused)} "
            f"(its keyword arguments: {', '.join(sorted(accepted)) or 'none'}); remove "
            f"{'it' if len(refused) == 1 else 'them'} or fix the name"
        )


def _finite(value: Any, what: str) -> float:
    if not isinstance(value, numbers.Real):  # int, float, bool (0/1), numpy integer and floating scalars
        raise TypeError(f"{what} must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{what} must be finite, got {number}")
    return number


def total_reward(result: float | Mapping[str, float]) -> tuple[float, dict[str, float]]:
    """(scalar reward, components) from what a reward function returned.

    A number gives `(x, {"reward": x})`; a mapping gives `(sum of its values, its items as floats)`.
    Numbers are any `numbers.Real` (int, float, bool as 0/1, numpy scalars). Raises TypeError for anything
    else, ValueError for NaN/inf or an empty mapping.
    """
    if isinstance(result, Mapping):
        if not result:
            raise ValueError("reward function returned an empty mapping: no components to sum")
        components = {str(name): _finite(value, f"reward component {name!r}") for name, value in result.items()}
        return math.fsum(components.values()), components
    scalar = _finite(result, "reward")
    return scalar, {"reward": scalar}


# ---------------------------------------------------------------------------------- user datasets


def _jsonl_rows(path: Path) -> Iterable[tuple[str, dict[str, Any]]]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield where, row


def _parquet_rows(path: Path) -> Iterable[tuple[str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ImportError(f"reading {path} needs pyarrow: `pip install pyarrow`") from error
    index = 0
    for batch in pq.ParquetFile(path).iter_batches():
        for row in batch.to_pylist():
            yield f"{path}, row {index}", row
            index += 1


def _datasets_rows(path: Path) -> Iterable[tuple[str, dict[str, Any]]]:
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            f"reading the datasets folder {path} needs the `datasets` package: `pip install datasets`"
        ) from error
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        raise ValueError(
            f"{path} holds several splits {sorted(loaded)}: point `source` at one of them ({path}/<split>)"
        )
    for index, row in enumerate(loaded):
        yield f"{path}, row {index}", row


def read_rows(source: str, *, what: str = "data source") -> Iterable[tuple[str, dict[str, Any]]]:
    """The rows of a user's dataset as (where, row) pairs, in file order: a `.jsonl` file (one JSON object a line;
    blank lines are skipped, not rows), a `.parquet` file (needs pyarrow), or a folder written by
    `datasets.Dataset.save_to_disk` (needs datasets). `where` names the row for error messages:
    `"<path>, line N"` (jsonl, 1-based lines) or `"<path>, row N"` (parquet and datasets, 0-based rows).

    The source is checked at once (before the first row is read): FileNotFoundError for a missing source,
    ValueError for an unknown kind; `what` names it in those messages ("prompt source", "sft source", ...).
    While iterating: ValueError naming the file and line for invalid JSON or a line that is not an object,
    ImportError (saying what to install) when an optional reader is missing, ValueError for a `datasets`
    folder of several splits. The rows are not validated further: that is the caller's shape to check.
    """
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{what} {source!r} does not exist")
    if path.is_dir():
        return _datasets_rows(path)
    if path.suffix == ".jsonl":
        return _jsonl_rows(path)
    if path.suffix == ".parquet":
        return _parquet_rows(path)
    raise ValueError(f"{what} {source!r}: expected a .jsonl or .parquet file, or a `datasets` folder")


def load_prompts(
    source: str, *, prompt_key: str = "prompt", messages_key: str = "messages", limit: int | None = None
) -> list[PromptRecord]:
    """Prompt records from a user's dataset: a `.jsonl` file, a `.parquet` file (needs pyarrow), or a folder
    written by `datasets.Dataset.save_to_disk` (needs datasets), read by `common.prompt_sources.load_source` with
    these two keys and the other keys' defaults (the rules there: a string or a chat under `prompt_key`, else a chat
    under `messages_key`; `answer` or veRL's ground truth as the label; other fields flattened into metadata, nulls
    left out). prompt_id = row index (blank jsonl lines are not rows). `limit` keeps the first rows only. Raises
    FileNotFoundError for a missing source, ImportError (saying what to install) when an optional reader is missing,
    ValueError naming the file and line/row for a malformed row, and ValueError for an unknown source kind or a
    dataset without rows.
    """
    from common.prompt_sources import RowMapping, load_source  # imports this module: not at the top

    return load_source(source, RowMapping(prompt_key=prompt_key, messages_key=messages_key), limit=limit)
