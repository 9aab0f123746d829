"""The embedded GSM8K-shaped task: word problems whose reference answer is a worked solution ending in `#### n`.

    from common.word_problems import word_problem_prompts
    records = word_problem_prompts(1024, seed=0, difficulty=1, split="train")
    records[0].metadata["answer"]   # 'Mia had 3 shells and found 4 more, so she has 3 + 4 = 7 shells.\\n#### 7'

Generated here from templates (people, objects; buying, getting, finding, giving, losing, boxes of, sharing), no
download. A row has the shape users bring from GSM8K: the user message is the question and INSTRUCTION, metadata
`answer` the worked solution (one line per step, each `a op b = c`, then `#### n` as the last line), `question`
and `difficulty`. `env.reward_fn = "math"` scores it (common.math_reward reads the number after the last `####` of
the reference); strict accuracy (common.eval_metrics) compares the completion's `#### n` with that number.

Levels (`_LEVELS`; every answer is a non-negative integer, every intermediate too):
  1: one step, addition: has a, buys / gets / finds b (a, b in 2..9; answers 4..18).
  2: one step, addition or subtraction: has a (2..20), gains or gives away / loses b (2..20, never more than a).
  3: two steps, each an addition or a subtraction (numbers 2..20; never below zero).
  4: boxes: k boxes of n (k 2..6, n 2..10, k * n), then one addition or subtraction (2..20).
  5: boxes, one addition or subtraction, then equal sharing among m friends (an exact division; answers >= 2).
Measured headroom (benchmarks/word_problems_headroom.py, results/word_problems_headroom.json): SmolLM2-135M-Instruct
with vLLM, 64 held-out prompts x 8 samples, temperature 1.0, 128 tokens, one worked example (env.shots = 1),
float32 (model.dtype auto), on an AMD EPYC with avx2, no avx512, 2 cores shared with other work:
  level 1: right after '####' 0.18 (last number 0.19), '####' written 0.89, 51 of 64 groups with a spread, 45 tokens
  level 2: right after '####' 0.12 (last number 0.13), '####' written 0.87, 29 of 64 groups with a spread, 48 tokens
  level 1 at 48 tokens (examples/word_problems.toml's limit): right 0.19 (last number 0.20), '####' written 0.80,
  51 of 64 groups with a spread, 34 tokens
so level 1 is the one to learn on: the math reward's mean there is ~0.20 + 0.1 x 0.80 = ~0.28 (right by the answer
it extracts, plus the format bonus; derived from these shares, not scored by common.math_reward), as level-1 arithmetic's 0.28, and 4 groups in 5 give GRPO a signal. Level 2
leaves 35 of 64 groups without a spread (nearly all wrong). Levels 3-5 (two and three steps) were not measured:
they are harder still, there for larger models.
The instruction and the worked example (level 1, no worked example, 32 prompts x 8, 128 tokens, the same machine):
INSTRUCTION's '####' was written in 0.12 of the samples and right in 0.004; "... put the final answer within
\\boxed{}." was followed in 0.004 and right in 0; both rambled to ~115 tokens. So the marker, and env.shots = 1: with
one worked example the marker is written in 0.89 and the answer is right in 0.18 (above).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from common.tasks import ANSWER_MARKER, SPLITS, PromptRecord

INSTRUCTION = f"Solve it step by step, then put the final answer after '{ANSWER_MARKER}'."
HELD_OUT_PERCENT = 20
MAX_SHOTS = 3
WORKED_EXAMPLE_SEED = -1  # the stream the worked examples come from: no run seed is negative (common.config)

# (name, subject pronoun, object pronoun)
_PEOPLE = (
    ("Tom", "he", "him"),
    ("Mia", "she", "her"),
    ("Sam", "he", "him"),
    ("Lily", "she", "her"),
    ("Ben", "he", "him"),
    ("Emma", "she", "her"),
    ("Leo", "he", "him"),
    ("Ava", "she", "her"),
    ("Max", "he", "him"),
    ("Zoe", "she", "her"),
    ("Omar", "he", "him"),
    ("Nina", "she", "her"),
)
_OBJECTS = (
    "apples",
    "pencils",
    "marbles",
    "stickers",
    "cookies",
    "books",
    "coins",
    "cards",
    "balloons",
    "shells",
    "crayons",
    "toy cars",
)
_CONTAINERS = ("boxes", "bags", "packs", "jars")


@dataclass(frozen=True)
class _Person:
    name: str
    he: str
    him: str


@dataclass(frozen=True)
class _Step:
    """One event of a story: its sentence in the question, its clause in the solution, and the arithmetic."""

    question: str  # "He buys 4 more marbles."
    solution: str  # "bought 4 more"  (follows "<name> had <x> <objects> and ..." or "Then <he> ...")
    op: str  # "+" or "-"
    amount: int


def _gain(rng: random.Random, who: _Person, friend: _Person, objects: str, low: int, high: int) -> _Step:
    amount = rng.randint(low, high)
    kind = rng.randrange(3)
    if kind == 0:
        return _Step(f"{who.he.capitalize()} buys {amount} more {objects}.", f"bought {amount} more", "+", amount)
    if kind == 1:
        return _Step(
            f"{friend.name} gives {who.him} {amount} {objects}.", f"got {amount} more from {friend.name}", "+", amount
        )
    return _Step(f"{who.he.capitalize()} finds {amount} more {objects}.", f"found {amount} more", "+", amount)


def _loss(rng: random.Random, who: _Person, friend: _Person, objects: str, low: int, have: int) -> _Step:
    amount = rng.randint(min(low, have), have)  # never more than there is: no answer below zero
    if rng.randrange(2) == 0:
        return _Step(
            f"{who.he.capitalize()} gives {amount} of them to {friend.name}.",
            f"gave {amount} to {friend.name}",
            "-",
            amount,
        )
    return _Step(f"{who.he.capitalize()} loses {amount} of them.", f"lost {amount}", "-", amount)


def _step(rng: random.Random, who: _Person, friend: _Person, objects: str, have: int, add: bool) -> _Step:
    if add or have < 2:  # nothing (or one) left to give: a gain instead
        return _gain(rng, who, friend, objects, 2, 20)
    return _loss(rng, who, friend, objects, 2, have)


@dataclass(frozen=True)
class WordProblem:
    """A generated problem: the question, the worked solution (its last line `#### answer`) and the answer."""

    question: str
    solution: str
    answer: int


def _apply(have: int, step: _Step) -> int:
    return have + step.amount if step.op == "+" else have - step.amount


def _story(who: _Person, objects: str, start: int, start_solution: str, steps: list[_Step]) -> tuple[list[str], int]:
    """The solution lines of the steps after the start, and the final count. The first step joins the start's
    sentence (`Tom had 3 apples and bought 4 more, so he has 3 + 4 = 7 apples.`), later ones begin with `Then`."""
    lines, have = [], start
    for i, step in enumerate(steps):
        after = _apply(have, step)
        tense = "has" if i == len(steps) - 1 else "had"
        lead = f"{start_solution} and {step.solution}" if i == 0 else f"Then {who.he} {step.solution}"
        lines.append(f"{lead}, so {who.he} {tense} {have} {step.op} {step.amount} = {after} {objects}.")
        have = after
    return lines, have


def _people(rng: random.Random) -> tuple[_Person, _Person, str]:
    who, friend = (_Person(*p) for p in rng.sample(_PEOPLE, 2))
    return who, friend, rng.choice(_OBJECTS)


def _counting(rng: random.Random, steps: int, add_only: bool, low: int, high: int) -> WordProblem:
    """Levels 1-3: has `start`, then `steps` gains or losses."""
    who, friend, objects = _people(rng)
    start = rng.randint(low, high)
    chosen, have = [], start
    for _ in range(steps):
        step = (
            _gain(rng, who, friend, objects, low, high)
            if add_only
            else _step(rng, who, friend, objects, have, rng.random() < 0.5)
        )
        chosen.append(step)
        have = _apply(have, step)
    question = " ".join([f"{who.name} has {start} {objects}.", *(s.question for s in chosen)])
    question += f" How many {objects} does {who.name} have now?"
    lines, answer = _story(who, objects, start, f"{who.name} had {start} {objects}", chosen)
    return WordProblem(question, "\n".join([*lines, f"{ANSWER_MARKER} {answer}"]), answer)


def _boxes(rng: random.Random, share: bool) -> WordProblem:
    """Levels 4-5: k containers of n, one gain or loss, and (level 5) equal sharing among m friends."""
    who, friend, objects = _people(rng)
    container = rng.choice(_CONTAINERS)
    k, n = rng.randint(2, 6), rng.randint(2, 10)
    total = k * n
    step = _step(rng, who, friend, objects, total, rng.random() < 0.5)
    have = _apply(total, step)
    if share:
        divisors = [m for m in range(2, 7) if have % m == 0 and have // m >= 2]
        if not divisors:  # a prime or too small a count: redraw (the stream stays reproducible)
            return _boxes(rng, share)
    question = f"{who.name} buys {k} {container} of {objects} with {n} {objects} in each. {step.question}"
    first = (
        f"{who.name} bought {k} {container} of {n} {objects}, so {who.he} had {k} * {n} = {total} {objects}.\n"
        f"Then {who.he} {step.solution}, so {who.he} {'had' if share else 'has'} {total} {step.op} {step.amount} = "
        f"{have} {objects}."
    )
    lines, answer = [first], have
    if share:
        m = rng.choice(divisors)
        answer = have // m
        question += f" {who.he.capitalize()} shares them equally among {m} friends. How many {objects} does each get?"
        lines.append(f"Shared equally among {m} friends, each gets {have} / {m} = {answer} {objects}.")
    else:
        question += f" How many {objects} does {who.name} have now?"
    return WordProblem(question, "\n".join([*lines, f"{ANSWER_MARKER} {answer}"]), answer)


_LEVELS: dict[int, Callable[[random.Random], WordProblem]] = {
    1: lambda rng: _counting(rng, 1, True, 2, 9),
    2: lambda rng: _counting(rng, 1, False, 2, 20),
    3: lambda rng: _counting(rng, 2, False, 2, 20),
    4: lambda rng: _boxes(rng, False),
    5: lambda rng: _boxes(rng, True),
}
DIFFICULTIES = tuple(sorted(_LEVELS))


def is_held_out(question: str) -> bool:
    """Whether a question belongs to the held-out split: a fixed ~20% (HELD_OUT_PERCENT) of the questions, chosen
    by SHA-256 of the question text (whitespace runs folded), so the split is the same on every machine, in every
    process, for every seed and level. The split is by text: a held-out `Tom has 3 apples. He buys 4 more...` may
    share its arithmetic (3 + 4) with a trained question about Mia's shells, but never its wording."""
    text = " ".join(question.split())
    digest = hashlib.sha256(f"tandem-word-problems-held-out:{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELD_OUT_PERCENT


def _problems(seed: int, difficulty: int, split: str) -> Callable[[], WordProblem]:
    rng = random.Random(f"tandem-word-problems:{seed}:{difficulty}")

    def draw() -> WordProblem:
        while True:
            problem = _LEVELS[difficulty](rng)
            if split == "all" or is_held_out(problem.question) == (split == "held_out"):
                return problem

    return draw


def word_problem_messages(question: str, *, shots: int = 0, difficulty: int = 1) -> list[dict[str, str]]:
    """The chat of one question: `shots` worked examples (earlier turns: a train-split problem of the same level
    from the fixed WORKED_EXAMPLE_SEED stream, answered by its worked solution), then `question` and INSTRUCTION.
    Raises ValueError for shots outside 0..MAX_SHOTS or an unknown difficulty."""
    if not 0 <= shots <= MAX_SHOTS:
        raise ValueError(f"shots must be in 0..{MAX_SHOTS} for word problems, got {shots}")
    if difficulty not in _LEVELS:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
    messages: list[dict[str, str]] = []
    draw = _problems(WORKED_EXAMPLE_SEED, difficulty, "train")
    for _ in range(shots):
        example = draw()
        messages.append({"role": "user", "content": f"{example.question} {INSTRUCTION}"})
        messages.append({"role": "assistant", "content": example.solution})
    return [*messages, {"role": "user", "content": f"{question} {INSTRUCTION}"}]


def word_problem_prompts(
    num_prompts: int, *, seed: int, difficulty: int, split: str = "all", shots: int = 0
) -> list[PromptRecord]:
    """`num_prompts` word problems of one level (see the module docstring for the levels, 1..5).

    Each user message is the question then INSTRUCTION (after `shots` worked examples, `word_problem_messages`).
    Metadata: `answer` (the worked solution, last line `#### n`, as GSM8K writes it), `question` and `difficulty`.
    Reproducible: the same (seed, difficulty, split, shots) gives the same records, and a shorter list is a prefix of
    a longer one; prompt_id = index. split: `all`, `train` (leaves out the questions `is_held_out` picks) or
    `held_out` (only those); the splits walk the same stream as `all` and drop the other side's questions.
    Questions may repeat within a list (level 1 has a few thousand distinct texts), never across the two splits.
    Raises ValueError for an unknown difficulty or split, a negative count, or shots outside 0..MAX_SHOTS.
    """
    if difficulty not in _LEVELS:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    examples = word_problem_messages("", shots=shots, difficulty=difficulty)[:-1]
    draw = _problems(seed, difficulty, split)
    records = []
    for prompt_id in range(num_prompts):
        problem = draw()
        messages = [*examples, {"role": "user", "content": f"{problem.question} {INSTRUCTION}"}]
        metadata = {"answer": problem.solution, "question": problem.question, "difficulty": difficulty}
        records.append(PromptRecord(prompt_id, [dict(m) for m in messages], metadata))
    return records
