"""Writing an example environment's prompt set as the `.jsonl` file its config names (`env.kind = "file"`).

    python -m examples.envs.calculator --write examples/envs/data/calculator.jsonl

Each line is one prompt as `common.tasks.load_prompts` reads it: `{"messages": [...], <metadata fields>}`; the
prompt's id is its line number. Metadata values are scalars (structured ones are JSON strings).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from common.tasks import PromptRecord


def to_jsonl(records: list[PromptRecord]) -> str:
    """The lines of a prompt file, in prompt_id order (ids must be 0..n-1: they are line numbers on reading)."""
    if [r.prompt_id for r in records] != list(range(len(records))):
        raise ValueError("prompt ids must be 0..n-1 in order: they become the line numbers of the file")
    return "".join(json.dumps({"messages": r.messages, **r.metadata}, sort_keys=True) + "\n" for r in records)


def main(generate: Callable[[int, int], list[PromptRecord]], default_count: int, argv: list[str] | None = None) -> int:
    """Command line of a prompt generator: `--write PATH [--num N] [--seed S]` (prints a sample without --write)."""
    parser = argparse.ArgumentParser(description="Write this environment's prompt set as JSON lines.")
    parser.add_argument("--write", type=Path, help="output .jsonl file")
    parser.add_argument("--num", type=int, default=default_count, help="prompts to generate")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    text = to_jsonl(generate(args.num, args.seed))
    if args.write is None:
        print("".join(text.splitlines(keepends=True)[:3]), end="")
        return 0
    args.write.parent.mkdir(parents=True, exist_ok=True)
    args.write.write_text(text)
    print(f"wrote {args.num} prompts to {args.write}")
    return 0
