"""The built-in math verifier (`env.reward_fn = "math"`): the final answer of a completion against a ground truth.

    from common.math_reward import math_reward
    math_reward("... so the total is \\boxed{\\frac{1}{2}}.", {"answer": "0.5"})   # {"correct": 1.0, "format": 0.1}
    # in a config: [env] reward_fn = "math"   reward_fn_args = {extract = ["boxed", "hash"], format_weight = 0.1}

Reading the answer (`extract`, tried in the order given; the first form found wins):
    boxed        the last well-formed `\\boxed{...}` or `\\fbox{...}` (nested braces; `\\{` `\\}` are literal), or
                 `\\boxed 5` (the token after a space)
    hash         the first non-blank line after the last `####` (GSM8K's form)
    answer_is    the rest of the last line saying "the (final) answer is ..." or starting "Answer: ..."
    last_number  the last number in the text (no format credit: it is not a form the model chose)
The ground truth `metadata[answer_key]` is a number, or a string: a MATH `solution` (its last `\\boxed{}`), a GSM8K
`answer` (the line after `####`), or else the whole string (plain, LaTeX, `$...$`).

Equivalence: a fast path first (the two texts equal once `$`, spaces and LaTeX spacing are stripped; or both exact
numbers: integers, decimals, `1,234`, `a/b`, `\\frac{a}{b}`, compared as fractions; against a plain number, an
answer such as `18 dollars` or `5\\text{ cm}` is its number), then math-verify in a worker process
(common/math_verify_worker.py): LaTeX, fractions, sets, intervals, equations, units text, percentages.
An integer against a different integer is decided by the fast path (unequal); other unequal numbers go to sympy,
whose float rounding (6 digits) may still call them equal, as math-verify would.

Time limit: math-verify's own timeouts use signal.alarm (main thread only) and reward functions run on a worker thread
(actors/rewards.TimedFunction), where a stuck call cannot be stopped. So comparisons run in a small pool of persistent
worker processes (common/math_verify_worker.py: plain `subprocess`, never a fork of a generator that may hold vLLM);
a comparison past `timeout_s` has its worker killed and replaced (the replacement starts importing at once, in the
background) and scores `correct = 0`: counted in `stats()`, logged the first time, never raised. An answer longer than MAX_ANSWER_CHARS (or 4x the gold's length) is wrong at once.

Cost, measured on this repo's CPU machine (AMD EPYC with AVX2 only, no avx512, no AMX; 2 cores shared with other work): the
fast path ~50-110 us a call (extraction included, short completions); a sympy comparison median 2.5 ms, up to ~330 ms
(sets, intervals), the pipe included; a worker's start (importing sympy and math_verify) ~2 s, paid by the first
comparison and, in the background, after each kill. tests/common/test_math_reward.py prints these with `-s`.
Importing this module is cheap (~40 ms, the standard library only): math_verify is imported in the workers.
"""

from __future__ import annotations

import atexit
import importlib.util
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from common.math_verify_worker import PIP_HINT, VerifierPool

FORMS = ("boxed", "hash", "answer_is", "last_number")
EXPLICIT_FORMS = ("boxed", "hash", "answer_is")  # forms that earn `format`
DEFAULT_EXTRACT = FORMS
DEFAULT_FORMAT_WEIGHT = 0.1  # as arithmetic_reward's: a shaping bonus that never lifts a wrong answer over a right one
DEFAULT_TIMEOUT_S = 3.0  # one comparison; keep it under env.reward_timeout_s less a worker's start (~1.5 s)
MAX_ANSWER_CHARS = 1000  # longer answers are wrong at once (a gold longer than a quarter of this raises the bound)
MAX_WORKERS = 4  # worker processes of one Python process, at most; more concurrent callers wait for one


# ------------------------------------------------------------------------------------------- extraction

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_IS = re.compile(r"(?im)(?:\bthe\s+(?:final\s+)?answer\s+is\b|^[ \t>*_#]*(?:final\s+)?answer[ \t*_]*:)")
_NUMBER_TEXT = re.compile(r"(?<![\d.])[-\u2212]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def _brace_pairs(text: str) -> dict[int, int]:
    """{index of `{`: index of its `}`} over the whole text in one pass; `\\{` and `\\}` are literal, not braces."""
    pairs, opened, i = {}, [], 0
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            opened.append(i)
        elif char == "}" and opened:
            pairs[opened.pop()] = i
        i += 1
    return pairs


def _boxed(text: str) -> str | None:
    """The content of the last well-formed `\\boxed{...}` / `\\fbox{...}` / `\\boxed x`; None when there is none."""
    commands = list(_BOX_COMMAND.finditer(text))
    pairs = _brace_pairs(text) if commands else {}
    for command in reversed(commands):
        start = command.end()
        if start < len(text) and text[start] == "{":
            if start in pairs:
                return text[start + 1 : pairs[start]]
            continue  # unbalanced: an earlier box may be whole
        token = re.match(r"[ \t]+([^\s$]+)", text[start : start + 200])
        if token:
            return token.group(1)
    return None


def _hash(text: str) -> str | None:
    if "####" not in text:
        return None
    after = text.rsplit("####", 1)[1]
    return next((line for line in after.splitlines() if line.strip()), None)


def _answer_is(text: str) -> str | None:
    matches = list(_ANSWER_IS.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :]
    return next((line.strip(" \t*_:") for line in rest.splitlines() if line.strip(" \t*_:")), None)  # markdown


def _last_number(text: str) -> str | None:
    numbers = _NUMBER_TEXT.findall(text)
    return numbers[-1] if numbers else None


_EXTRACTORS = {"boxed": _boxed, "hash": _hash, "answer_is": _answer_is, "last_number": _last_number}


def extract_answer(text: str, extract: Sequence[str] = DEFAULT_EXTRACT) -> tuple[str | None, str | None]:
    """(answer text, the form it came in) from a completion, trying the forms of `extract` in order (see the module
    docstring); (None, None) when no form finds one. The answer keeps its LaTeX; `cleaned` strips its dressing.
    Linear in the text's length (one brace pass, anchored regexes)."""
    for form in extract:
        answer = _EXTRACTORS[form](text)
        if answer is not None and cleaned(answer):
            return answer, form
    return None, None


def gold_answer(value: Any, where: str = "metadata['answer']") -> str:
    """The text of a ground truth: a number as written by Python (an integral float as an int), a string's last
    `\\boxed{}` (MATH's `solution`) or the line after its last `####` (GSM8K), else the whole string.
    Raises ValueError for a bool, another type, or a string without an answer (empty)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{where} = {value!r}: expected a number or a string (plain, LaTeX, or a worked solution)")
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, int):
        return str(value)
    answer, _ = extract_answer(value, ("boxed", "hash"))
    if answer is None and ("####" in value or _BOX_COMMAND.search(value)):
        raise ValueError(f"{where} = {value!r}: a worked solution without an answer (an empty \\boxed{{}} or '####')")
    answer = value if answer is None else answer
    if not cleaned(answer):
        raise ValueError(f"{where} = {value!r}: no answer in it (empty, or an empty \\boxed{{}} or '####' line)")
    return answer


# ------------------------------------------------------------------------------------------ the fast path

_DRESSING = re.compile(r"\\[!,;: ]|\\(?:left|right)(?![A-Za-z])|\\displaystyle|~|\s+")
_FRACTION = re.compile(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}|\\[dt]?frac(\d)(\d)|(-?\d+)/(\d+)")
_DECIMAL = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
MAX_FAST_DIGITS = 60  # longer numbers go to sympy (and Python's int() refuses more than 4,300 digits anyway)
# A number, then words of units (`18 dollars`, `5 square feet.`, `3\text{ cm}`): words of 2+ letters after a space,
# so `2x` or `2 x` (a product) is not read as 2. Only against a plain-number gold (see fast_equal).
_NUMBER_AND_UNITS = re.compile(
    r"\$?\s*([-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)(?:\s+[A-Za-z]{2,})+\.?"
    r"|\$?\s*([-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z ]*\}\.?"
)


def cleaned(answer: str) -> str:
    """An answer without its dressing: surrounding `$`, `\\(...\\)`, `\\[...\\]`, spaces and LaTeX spacing
    (`\\!`, `\\,`, `~`, `\\left`/`\\right`), a leading `\\$`, a trailing period; U+2212 as `-`."""
    text = answer.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(text) >= len(left) + len(right) and text.startswith(left) and text.endswith(right):
            text = text[len(left) : -len(right)]
    text = _DRESSING.sub("", text).replace("\u2212", "-").rstrip(".")
    return text.removeprefix("\\$").removeprefix("$").removesuffix("$")


def exact_number(text: str) -> Fraction | None:
    """The exact value of a cleaned answer that is a plain number (`-12`, `1,234`, `0.5`, `3/4`, `\\frac{3}{4}`,
    `\\frac34`); None for anything else, or a number of more than MAX_FAST_DIGITS characters."""
    if len(text) > MAX_FAST_DIGITS:
        return None
    if _DECIMAL.fullmatch(text):
        return Fraction(text.replace(",", ""))
    matched = _FRACTION.fullmatch(text)
    if matched is None:
        return None
    numerator, denominator = [group for group in matched.groups() if group is not None]
    return Fraction(int(numerator), int(denominator)) if int(denominator) else None


def fast_equal(gold: str, answer: str) -> bool | None:
    """True/False when decidable without sympy (see the module docstring), else None."""
    gold_text, answer_text = cleaned(gold), cleaned(answer)
    if gold_text == answer_text:
        return True
    gold_value, answer_value = exact_number(gold_text), exact_number(answer_text)
    if gold_value is not None and answer_value is None:
        with_units = _NUMBER_AND_UNITS.fullmatch(answer.strip().strip("$").strip())
        if with_units:
            answer_value = exact_number(cleaned(with_units.group(1) or with_units.group(2)))
    if gold_value is None or answer_value is None:
        return None
    if gold_value == answer_value:
        return True
    if gold_value.denominator == 1 and answer_value.denominator == 1:
        return False
    return None


_POOL = VerifierPool(MAX_WORKERS)
atexit.register(_POOL.close)  # the workers die with us anyway (PR_SET_PDEATHSIG)
_counts = {"fast": 0, "too_long": 0}


def shutdown() -> None:
    """Kill this process's verifier workers (also at exit); the next comparison starts a fresh one."""
    _POOL.close()


def stats() -> dict[str, int]:
    """Counts of this process: `fast` (decided without sympy), `too_long` (answers refused by length), `compared`
    (sent to a worker), `timeouts` (scored 0 past the limit) and `restarts` (workers replaced)."""
    return {**_counts, **_POOL.counts}


def _require_math_verify() -> None:
    if importlib.util.find_spec("math_verify") is None:
        raise ImportError(f"the math reward needs the math-verify package, which is not installed: {PIP_HINT}")


# -------------------------------------------------------------------------------------------- the reward


def answers_equal(gold: str, answer: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether `answer` is the ground truth `gold` (both answer texts, see `extract_answer` / `gold_answer`): the
    fast path, else math-verify in a worker within `timeout_s` (False past it)."""
    if len(answer) > max(MAX_ANSWER_CHARS, 4 * len(gold)):
        _counts["too_long"] += 1
        return False
    decided = fast_equal(gold, answer)
    if decided is not None:
        _counts["fast"] += 1
        return decided
    _require_math_verify()
    return bool(_POOL.equal(gold, answer, timeout_s))


def math_reward(
    completion: str,
    metadata: Mapping[str, Any],
    *,
    extract: Sequence[str] = DEFAULT_EXTRACT,
    answer_key: str = "answer",
    format_weight: float = DEFAULT_FORMAT_WEIGHT,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, float]:
    """Verifiable math reward: `{"correct": 1.0 | 0.0, "format": format_weight | 0.0}`; the scalar reward is the sum.

    correct: the completion's answer (`extract`: the forms tried, in order; see the module docstring) equals the
    ground truth `metadata[answer_key]` (`gold_answer`), by the fast path or math-verify within `timeout_s`
    (a comparison past it scores 0, counted in `stats()`). No answer found: 0.
    format: `format_weight` when the answer came in an explicit form (boxed, hash, answer_is), right or not.
    Raises KeyError when metadata has no `answer_key`, ValueError for a ground truth without an answer or bad
    arguments (`check_args`), ImportError (saying what to pip install) without math-verify.
    """
    check_args({"extract": extract, "format_weight": format_weight, "timeout_s": timeout_s})
    if answer_key not in metadata:
        raise KeyError(
            f"math_reward needs metadata[{answer_key!r}] (reward_fn_args.answer_key), got {sorted(metadata)}"
        )
    gold = gold_answer(metadata[answer_key], f"metadata[{answer_key!r}]")
    answer, form = extract_answer(completion, extract)
    correct = answer is not None and answers_equal(gold, answer, timeout_s=timeout_s)
    return {"correct": 1.0 if correct else 0.0, "format": float(format_weight) if form in EXPLICIT_FORMS else 0.0}


def check_args(args: Mapping[str, Any]) -> None:
    """Refuse bad values of math_reward's keyword arguments (common.tasks.resolve_reward_fn calls this once at
    start-up with env.reward_fn_args): ValueError naming the argument and what it takes."""
    extract = args.get("extract", DEFAULT_EXTRACT)
    if isinstance(extract, str) or not extract or any(form not in FORMS for form in extract):
        raise ValueError(f"math_reward: extract = {extract!r}: a non-empty list of {', '.join(FORMS)}")
    if len(set(extract)) != len(extract):
        raise ValueError(f"math_reward: extract = {list(extract)!r} names a form twice")
    for name in ("format_weight", "timeout_s"):
        value = args.get(name, 1.0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ValueError(f"math_reward: {name} = {value!r}: must be a number >= 0")
    if args.get("timeout_s", 1.0) == 0:
        raise ValueError("math_reward: timeout_s = 0: must be > 0 (seconds one comparison may take)")
    if not isinstance(args.get("answer_key", "answer"), str):
        raise ValueError(f"math_reward: answer_key = {args['answer_key']!r}: must be a string (a metadata key)")


math_reward.check_args = check_args  # type: ignore[attr-defined]  # resolve_reward_fn's start-up check
