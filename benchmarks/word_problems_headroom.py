"""Which word-problem level leaves the embedded model headroom: base-model reward and group spread per level.

    .venv/bin/python -m benchmarks.word_problems_headroom --levels 1,2,3 --prompts 64 --samples 8 --max-tokens 160
    .venv/bin/python -m benchmarks.word_problems_headroom --levels 1 --shots 0 --instructions marker,boxed

One vLLM engine (SmolLM2-135M-Instruct, the demo's model settings) samples `--samples` completions of each of the
first `--prompts` held-out word problems (common.word_problems, the split evaluation measures) at temperature 1.0.
Per level it prints: `correct` (the answer after the last `####`, or in the last `\\boxed{}` for the boxed
instruction, equals the reference's `#### n`: what a math reward gives), `marker` (the share that wrote the marker
the instruction asks for), lenient (the last number anywhere is right), and `spread` (groups neither all right nor
all wrong: the groups GRPO learns from). The correctness check here is a measuring aid only, not a verifier: runs
score with env.reward_fn (common.math_reward). Writes benchmarks/results/word_problems_headroom.json (runs keyed by shots and max tokens).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

from benchmarks.common import RESULTS, save
from common.eval_metrics import answer_verdicts, expected_answer
from common.tasks import PromptRecord
from common.word_problems import INSTRUCTION, word_problem_prompts

NAME = "word_problems_headroom"
BOXED_INSTRUCTION = "Solve it step by step, then put the final answer within \\boxed{}."
_BOXED = re.compile(r"\\boxed\{\s*([-\d.,]+)\s*\}")


def _with_instruction(record: PromptRecord, instruction: str) -> PromptRecord:
    messages = [dict(m) for m in record.messages]
    messages[-1]["content"] = messages[-1]["content"].replace(INSTRUCTION, instruction)
    return PromptRecord(record.prompt_id, messages, dict(record.metadata))


def _verdict(text: str, expected: float, boxed: bool) -> tuple[bool, bool, bool]:
    """(correct, marker written, lenient) of one completion."""
    strict, lenient = answer_verdicts(text, expected)
    if not boxed:
        return strict, "####" in text, lenient
    found = _BOXED.findall(text)
    right = bool(found) and _number(found[-1]) == expected
    return right, bool(found), lenient or right


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def measure(engine: Any, records: list[PromptRecord], samples: int, boxed: bool) -> dict[str, Any]:
    from actors.engine.offline_sampling import sample_completions

    started = time.monotonic()
    groups = sample_completions(engine, records, samples)
    seconds = time.monotonic() - started
    correct = marker = lenient = spread = 0
    tokens = 0
    for record, group in zip(records, groups, strict=True):
        expected = expected_answer(record.metadata)
        assert expected is not None
        verdicts = [_verdict(c.text, expected, boxed) for c in group]
        right = sum(v[0] for v in verdicts)
        correct += right
        marker += sum(v[1] for v in verdicts)
        lenient += sum(v[2] for v in verdicts)
        spread += 0 < right < len(group)
        tokens += sum(c.num_tokens for c in group)
    n = len(records) * samples
    return {
        "correct": correct / n,
        "marker": marker / n,
        "lenient": lenient / n,
        "groups_with_spread": spread,
        "groups": len(records),
        "mean_tokens": tokens / n,
        "seconds": seconds,
        "example": groups[0][0].text,
    }


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """Per run (shots, tokens), instruction and level: the share right and the groups with a spread, from a saved result."""
    figures = {}
    for run, saved in result["runs"].items():
        for key, level in saved["levels"].items():
            figures[f"{run}/{key}/correct"] = round(level["correct"], 3)
            figures[f"{run}/{key}/groups_with_spread"] = f"{level['groups_with_spread']}/{level['groups']}"
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,2,3")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--shots", type=int, default=0)
    parser.add_argument("--instructions", default="marker", help="comma-separated: marker (INSTRUCTION), boxed")
    args = parser.parse_args()

    from actors.engine.offline_sampling import open_eval_engine
    from common.config import load_config
    from common.model_prep import resolve_model_path
    from launch.cli import DEMO_CONFIG

    config = load_config(DEMO_CONFIG)
    engine = open_eval_engine(
        resolve_model_path("smollm2"),
        config.model,
        config.generator,
        temperature=1.0,
        max_tokens=args.max_tokens,
        seed=0,
    )
    results: dict[str, Any] = {}
    try:
        for instruction in args.instructions.split(","):
            boxed = instruction == "boxed"
            for level in (int(x) for x in args.levels.split(",")):
                records = word_problem_prompts(
                    args.prompts, seed=0, difficulty=level, split="held_out", shots=args.shots
                )
                if boxed:
                    records = [_with_instruction(r, BOXED_INSTRUCTION) for r in records]
                results[f"{instruction}/level_{level}"] = figures = measure(engine, records, args.samples, boxed)
                shown = {k: v for k, v in figures.items() if k != "example"}
                print(f"{instruction} level {level}: {shown}\n  example: {figures['example']!r}", flush=True)
    finally:
        engine.shutdown()
    saved = RESULTS / f"{NAME}.json"  # one file; a run of other shots or tokens keeps the runs saved before it
    runs = json.loads(saved.read_text())["runs"] if saved.exists() else {}
    runs[f"shots{args.shots}_tokens{args.max_tokens}"] = {"settings": vars(args), "levels": results}
    save(NAME, {"runs": runs, "headline": headline({"runs": runs})})


if __name__ == "__main__":
    main()
