"""Data that ships for the RLHF stages: SFT chats and preference pairs built from the embedded arithmetic task.

    python -m common.rlhf_data data/rlhf --n 512 --difficulty 1     # sft_{train,eval}.jsonl, pairs_{train,eval}.jsonl

    from common.rlhf_data import arithmetic_preference_rows, arithmetic_sft_rows
    chats = arithmetic_sft_rows(512, seed=0, difficulty=1)               # [{"messages": [user, assistant]}, ...]
    pairs = arithmetic_preference_rows(128, seed=0, difficulty=1, split="held_out")

Every row's user message is exactly the RL prompt (`common.tasks.arithmetic_prompts`), so a model fine-tuned or a
reward model trained here sees, in the RL loop, the prompts it learned on, rendered the same way. A chosen reply
(and every SFT reply) is correct and well formatted, ending in the marker line the verifier's strict check reads:
`3 + 4 = 7\\n#### 7`. The rows are in TRL's conversational shape (`messages`; `prompt`/`chosen`/`rejected` as lists
of messages), which `tandem sft|rm|dpo` read from any jsonl as well: the written files show the shape to copy.
The training split (`split="train"`) and the held-out split are disjoint by expression (`common.tasks.is_held_out`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.tasks import ANSWER_MARKER, DIFFICULTIES, PromptRecord, arithmetic_prompts, evaluate_expression

Phrasing = Callable[[str, int], str]  # (expression, value) -> reply text

# How a correct reply is phrased (SFT replies and chosen replies draw from the same list). Each ends in the
# marker line; the short form the prompt asks for is listed twice (half the replies), the others vary the wording
# and the length so that a reward model cannot tell chosen from rejected by length alone (rambling rejections are
# long).
_CORRECT_PHRASINGS: tuple[Phrasing, ...] = (
    lambda e, a: f"{e} = {a}\n{ANSWER_MARKER} {a}",
    lambda e, a: f"{e} = {a}\n{ANSWER_MARKER} {a}",
    lambda e, a: f"{e} equals {a}.\n{ANSWER_MARKER} {a}",
    lambda e, a: f"Let me work it out step by step: {e} = {a}. So the final answer is {a}.\n{ANSWER_MARKER} {a}",
)

# Rejection kinds and their counts in every block of 20 pairs (the shares: 30, 20, 10, 15, 10, 15 %).
#   wrong_near       a near miss in the right format (off by 1, 2, or 10 past level 1): `3 + 4 = 8\n#### 8`
#   wrong_operation  the result of the wrong operation, right format: `3 + 4 = -1\n#### -1` (one + - * swapped)
#   no_marker_right  the right answer without the marker line: `3 + 4 = 7` (correct by the verifier's fallback to
#                    the last number, but unformatted)
#   no_marker_wrong  a wrong answer (a near miss) without the marker line: `3 + 4 = 8`
#   marker_no_number the marker with no number anywhere: `I'll put the answer after the marker.\n####`
#   rambling_wrong   a long reply that names the right answer on the way and ends on a wrong one, no marker
# These four keep the chosen reply's wording (a minimal pair: only the value or only the marker line differs).
# Why these shares: in 90% of the pairs the rejected answer is wrong (every kind but no_marker_right), and in 50% of
# all pairs (wrong_near, wrong_operation) it is wrong ONLY: same wording, format and length as the chosen reply. A
# reward model that learned the format alone is at chance on those, ~0.75 pairwise accuracy overall, short of the
# 0.9 the chain asks for. The near miss is the most common kind because it is what a policy that has learned the
# format gets wrong most. no_marker_right (10%) is the one kind that teaches the format alone: a correct reply still
# loses to the same reply with the marker line.
REJECTION_KINDS: dict[str, int] = {
    "wrong_near": 6,
    "wrong_operation": 4,
    "no_marker_right": 2,
    "no_marker_wrong": 3,
    "marker_no_number": 2,
    "rambling_wrong": 3,
}

_NO_NUMBER_REPLIES = (
    f"I will put the final answer after the marker.\n{ANSWER_MARKER}",
    f"{ANSWER_MARKER}",
    f"The final answer goes here:\n{ANSWER_MARKER} ?",
    f"Let me think about it.\n{ANSWER_MARKER} the answer",
)


def _rng(kind: str, seed: int, difficulty: int, split: str) -> random.Random:
    return random.Random(f"tandem-rlhf-{kind}:{seed}:{difficulty}:{split}")


def _user_message(record: PromptRecord) -> dict[str, str]:
    (message,) = record.messages  # arithmetic prompts are one user message
    return dict(message)


def _assistant(content: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": content}]


def correct_reply(expression: str, answer: int, rng: random.Random) -> str:
    """A correct, well-formatted reply to `What is <expression>?`, ending in `#### <answer>` (phrasing from rng)."""
    return rng.choice(_CORRECT_PHRASINGS)(expression, answer)


def arithmetic_sft_rows(n: int, *, seed: int, difficulty: int, split: str = "train") -> list[dict[str, Any]]:
    """`n` chats `{"messages": [user, assistant]}`: the user message is the RL prompt of
    `arithmetic_prompts(n, seed=seed, difficulty=difficulty, split=split)` (same order), the reply a correct,
    well-formatted one (`correct_reply`). Deterministic from the arguments; a shorter list is a prefix of a longer
    one. Raises ValueError as arithmetic_prompts does (unknown difficulty or split, negative n)."""
    rng = _rng("sft", seed, difficulty, split)
    rows = []
    for record in arithmetic_prompts(n, seed=seed, difficulty=difficulty, split=split):
        expression, answer = str(record.metadata["expression"]), int(record.metadata["answer"])
        rows.append({"messages": [_user_message(record), *_assistant(correct_reply(expression, answer, rng))]})
    return rows


def _near_miss(answer: int, difficulty: int, rng: random.Random) -> int:
    """A wrong answer close to `answer`: off by one (2 times in 3), else by 2 or (past level 1: a carry slip) 10.
    Never negative where every answer of the level is non-negative (levels 1 and 2)."""
    deltas = (-1, 1, -1, 1, -2, 2) if difficulty == 1 else (-1, 1, -1, 1, -1, 1, -2, 2, -10, 10)
    wrong = answer + rng.choice(deltas)
    if wrong < 0 and difficulty <= 2:
        wrong = answer + 1
    return wrong


def _wrong_operation(expression: str, answer: int, difficulty: int, rng: random.Random) -> int:
    """The value of `expression` with one operator swapped (+ -> -, - -> +, * -> +), a random one first; a near
    miss when every swap gives the right answer again (`3 + 0`: 3 - 0 = 3)."""
    tokens = expression.split(" ")
    operators = [i for i, token in enumerate(tokens) if token in ("+", "-", "*")]
    rng.shuffle(operators)
    for i in operators:
        swapped = tokens.copy()
        swapped[i] = {"+": "-", "-": "+", "*": "+"}[tokens[i]]
        wrong = evaluate_expression(" ".join(swapped))
        if wrong != answer:
            return wrong
    return _near_miss(answer, difficulty, rng)


def _rambling(expression: str, answer: int, wrong: int, rng: random.Random) -> str:
    openings = ("Hmm, let me think about this.", "Okay, so the question asks about", "Let's see.")
    return (
        f"{rng.choice(openings)} We need {expression}. At first glance it looks like {answer}, but I am not sure, "
        f"so let me go over it again carefully, one step at a time. Checking once more, I get {wrong}. "
        f"So the answer is {wrong}."
    )


def rejected_reply(
    kind: str, expression: str, answer: int, difficulty: int, rng: random.Random, phrasing: Phrasing | None = None
) -> str:
    """A reply of rejection `kind` (see REJECTION_KINDS) to `What is <expression>?` whose right answer is `answer`.
    The kinds that keep a reply's wording (wrong_near, wrong_operation, no_marker_right, no_marker_wrong) use
    `phrasing` (one of the correct replies' phrasings; the short form by default), so that a pair of the same
    phrasing differs only in the value or only in the marker line. Raises KeyError for an unknown kind."""
    phrase = phrasing or _CORRECT_PHRASINGS[0]

    def unmarked(value: int) -> str:
        return phrase(expression, value).rsplit("\n", 1)[0]  # the phrasing without its marker line

    builders: dict[str, Callable[[], str]] = {
        "wrong_near": lambda: phrase(expression, _near_miss(answer, difficulty, rng)),
        "wrong_operation": lambda: phrase(expression, _wrong_operation(expression, answer, difficulty, rng)),
        "no_marker_right": lambda: unmarked(answer),
        "no_marker_wrong": lambda: unmarked(_near_miss(answer, difficulty, rng)),
        "marker_no_number": lambda: rng.choice(_NO_NUMBER_REPLIES),
        "rambling_wrong": lambda: _rambling(expression, answer, _near_miss(answer, difficulty, rng), rng),
    }
    if kind not in builders:
        raise KeyError(f"unknown rejection kind {kind!r}; the kinds are {sorted(builders)}")
    return builders[kind]()


def _rejection_schedule(n: int, rng: random.Random) -> list[str]:
    """`n` kinds: blocks of 20 holding each kind its REJECTION_KINDS count, shuffled within the block, so every
    kind is in every full block and the shares are exact over whole blocks (a prefix of a longer schedule)."""
    kinds: list[str] = []
    block = [kind for kind, count in REJECTION_KINDS.items() for _ in range(count)]
    while len(kinds) < n:
        rng.shuffle(block)
        kinds.extend(block)
    return kinds[:n]


def arithmetic_preference_rows(n: int, *, seed: int, difficulty: int, split: str = "train") -> list[dict[str, Any]]:
    """`n` preference pairs `{"prompt": [user], "chosen": [assistant], "rejected": [assistant], "rejection": kind}`,
    one per prompt of `arithmetic_prompts(n, seed=seed, difficulty=difficulty, split=split)` (same order). The chosen
    reply is a correct, well-formatted one (a `correct_reply` phrasing); the rejected one is of the kind the schedule
    gives (REJECTION_KINDS: their shares and why), in the chosen reply's wording where its kind keeps one. Every
    rejected reply scores lower than its chosen one under `common.tasks.arithmetic_reward` (wrong, or unformatted,
    or both). Deterministic from the arguments; a shorter list is a prefix of a longer one. Raises ValueError as
    arithmetic_prompts does."""
    rng = _rng("pairs", seed, difficulty, split)
    records = arithmetic_prompts(n, seed=seed, difficulty=difficulty, split=split)
    rows = []
    for record, kind in zip(records, _rejection_schedule(n, _rng("kinds", seed, difficulty, split)), strict=True):
        expression, answer = str(record.metadata["expression"]), int(record.metadata["answer"])
        phrasing = rng.choice(_CORRECT_PHRASINGS)  # one wording for both sides of the pair
        rows.append(
            {
                "prompt": [_user_message(record)],
                "chosen": _assistant(phrasing(expression, answer)),
                "rejected": _assistant(rejected_reply(kind, expression, answer, difficulty, rng, phrasing)),
                "rejection": kind,
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """One JSON object a line, UTF-8, written whole (to a temporary name, then renamed)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    partial.replace(path)


def write_files(out_dir: Path, *, n: int, n_eval: int, seed: int, difficulty: int) -> list[Path]:
    """sft_train.jsonl, sft_eval.jsonl, pairs_train.jsonl, pairs_eval.jsonl in `out_dir` (made if missing): the
    train files from split "train" (`n` rows each), the eval files from split "held_out" (`n_eval` rows each)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "sft_train.jsonl": arithmetic_sft_rows(n, seed=seed, difficulty=difficulty, split="train"),
        "sft_eval.jsonl": arithmetic_sft_rows(n_eval, seed=seed, difficulty=difficulty, split="held_out"),
        "pairs_train.jsonl": arithmetic_preference_rows(n, seed=seed, difficulty=difficulty, split="train"),
        "pairs_eval.jsonl": arithmetic_preference_rows(n_eval, seed=seed, difficulty=difficulty, split="held_out"),
    }
    for name, rows in files.items():
        write_jsonl(out_dir / name, rows)
    return [out_dir / name for name in files]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m common.rlhf_data",
        description="Write the embedded arithmetic task's SFT chats and preference pairs as jsonl (TRL shape).",
    )
    parser.add_argument("out_dir", type=Path, help="folder for sft_{train,eval}.jsonl and pairs_{train,eval}.jsonl")
    parser.add_argument("--n", type=int, default=512, help="training rows per file (default 512)")
    parser.add_argument("--n-eval", type=int, default=128, help="held-out rows per file (default 128)")
    parser.add_argument("--difficulty", type=int, default=1, choices=DIFFICULTIES, help="arithmetic level (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and replies (default 0)")
    args = parser.parse_args(argv)
    if args.n < 1 or args.n_eval < 1:
        parser.error("--n and --n-eval must be at least 1")
    paths = write_files(args.out_dir, n=args.n, n_eval=args.n_eval, seed=args.seed, difficulty=args.difficulty)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
