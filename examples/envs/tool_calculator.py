"""The calculator as a real function tool: the model calls `calculate(expression)` in the Hermes format of its
chat template, gets `tool` messages back, and answers the word problem after '####'.

    [env]
    kind = "file"
    source = "examples/envs/data/calculator.jsonl"     # the problems of examples.envs.calculator (same generator)
    environment = "examples.envs.tool_calculator:ToolCalculatorEnv"

The environment declares `tools` (common.envs): the episode driver adds the `<tools>` block with the JSON schema of
`calculate` to the system message, and the model calls it as

    <tool_call>{"name": "calculate", "arguments": {"expression": "796 * 91 + 210"}}</tool_call>

`question`: "word" asks the task's word problem; "expression" asks "What is <its expression>?" (the same
arithmetic without the story: the model copies it into a call far more often). The chat opens with `shots` solved
problems (`demonstrations`: call, result, answer) before the task's problem:
the 135M model does not find the format from the instructions alone.

Each turn: a turn whose text outside the call blocks has '#### ANSWER' ends the episode (its calls are not run).
Otherwise its calls (at most `max_calls_per_turn`, in order) run through a `common.tool_calls.Toolbox`, one `tool`
message each: the value, or `error: ...` (unknown tool, arguments that break the schema, an expression the
calculator refuses). Malformed or unclosed blocks get one `user` message saying what was wrong; a turn with neither
calls nor an answer gets a reminder. After `max_turns` turns the environment ends the episode itself (reward 0).

Rewards: terminal 1.0 when the answer after '####' equals the task's answer (`common.tasks.parse_answer`), else 0.0;
`call_bonus` (a turn reward, once an episode) for the first turn with a valid call, so a model that has not yet
found the format gets a signal before it gets answers right. The learner's `reward/terminal` is then the share of
right answers and `reward/turn_reward_sum / call_bonus` the share of episodes with a valid call.

Per-episode tool use, in the final step's `info["tool_use"]` and, when `episode_log` is a path, one JSON line per
episode appended there: `valid_calls` (ran without error), `failed_calls` (parsed, but the tool refused them),
`malformed_calls` (blocks that do not parse), `correct`, and `tool_use_success` (at least one valid call and the
right answer). `python -m examples.envs.tool_calculator --summary FILE` prints the first and the last 20% of such
a log.

Safety: expressions go to `examples.envs.calculator.evaluate`, an AST walk over numbers, + - * / and parentheses
with exact fractions and size limits; nothing is passed to Python's eval.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common.envs import StepResult
from common.tasks import ANSWER_MARKER, parse_answer
from common.tool_calls import Toolbox, parse_tool_calls, tool_message
from examples.envs.calculator import calculator_prompts, evaluate, format_value

SYSTEM = (
    "You solve arithmetic word problems. Do not compute products in your head: call the calculate tool, read its "
    f"result, then write the final answer as '{ANSWER_MARKER} <number>'."
)
CALCULATE_SCHEMA = {
    "type": "object",
    "properties": {
        "expression": {
            "type": "string",
            "description": "Arithmetic with numbers, + - * / and parentheses, e.g. '796 * 91 + 210'.",
        }
    },
    "required": ["expression"],
    "additionalProperties": False,
}
_LOG_LOCK = threading.Lock()  # episodes run in several env worker threads; one line is written at a time


def calculate(expression: str) -> str:
    """The exact value of `expression` (an integer, or a decimal with up to 10 places); CalcError otherwise."""
    return format_value(evaluate(expression))


def calculator_toolbox() -> Toolbox:
    """A Toolbox holding `calculate` with its JSON schema."""
    box = Toolbox()
    box.register(calculate, CALCULATE_SCHEMA, "Evaluate an arithmetic expression exactly.")
    return box


TOOLBOX = calculator_toolbox()  # stateless: shared by every episode
QUESTIONS = ("word", "expression")
SHOT_SEED = 1_000_003  # demonstrations come from examples.envs.calculator's generator with this seed, not the task's


def ask(expression: str) -> dict[str, str]:
    """The bare question of `question = "expression"`: the problem's arithmetic without its story."""
    return {"role": "user", "content": f"What is {expression}?"}


def demonstrations(count: int, question: str = "word") -> list[dict[str, str]]:
    """`count` solved problems as earlier turns of the chat: the problem, a `calculate` call on its expression, the
    tool's result, and '#### <result>'. Without them SmolLM2-135M never called the tool in 24 samples; with two,
    about one sample in six makes a valid call on a word problem, and 14 in 32 on a bare expression (measured with
    transformers, temperature 1, 32 samples of 4 problems). `question` as for the environment."""
    chat = []
    for demo in calculator_prompts(count, seed=SHOT_SEED):
        expression = demo.metadata["expression"]
        call = json.dumps({"name": "calculate", "arguments": {"expression": expression}})
        value = calculate(expression)
        chat += [
            *(demo.messages if question == "word" else [ask(expression)]),
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": value},
            {"role": "assistant", "content": f"{ANSWER_MARKER} {value}"},
        ]
    return chat


class ToolCalculatorEnv:
    """One episode of a word problem with the `calculate` tool (see the module docstring)."""

    tools = TOOLBOX.tools  # read by the episode driver after reset (common.envs)

    def __init__(
        self,
        max_calls_per_turn: int = 2,
        call_bonus: float = 0.1,
        max_turns: int = 3,
        shots: int = 2,
        question: str = "word",
        episode_log: str = "",
    ) -> None:
        self.shots, self.question = shots, question
        self.max_calls_per_turn = max_calls_per_turn
        self.call_bonus = call_bonus
        self.max_turns = max_turns
        self.episode_log = episode_log

    @classmethod
    def prepare(
        cls,
        max_calls_per_turn: int = 2,
        call_bonus: float = 0.1,
        max_turns: int = 3,
        shots: int = 2,
        question: str = "word",
        episode_log: str = "",
    ) -> None:
        """Start-up check of `env.environment_args` (common.envs)."""
        if question not in QUESTIONS:
            raise ValueError(f"tool_calculator: question must be one of {QUESTIONS}, got {question!r}")
        if shots < 0:
            raise ValueError(f"tool_calculator: shots must be >= 0, got {shots}")
        if max_calls_per_turn < 1 or max_turns < 1:
            raise ValueError("tool_calculator: max_calls_per_turn and max_turns must be >= 1")
        if not 0.0 <= call_bonus < 1.0:
            raise ValueError(f"tool_calculator: call_bonus must be in [0, 1) (below a right answer), got {call_bonus}")
        if episode_log:
            Path(episode_log).parent.mkdir(parents=True, exist_ok=True)

    def reset(self, task: Any) -> list[dict[str, str]]:
        self.answer = int(task.metadata["answer"])
        self.prompt_id = getattr(task, "prompt_id", None)
        self.turns = 0
        self.counts = {"valid_calls": 0, "failed_calls": 0, "malformed_calls": 0}
        problem = task.messages if self.question == "word" else [ask(task.metadata["expression"])]
        return [{"role": "system", "content": SYSTEM}, *demonstrations(self.shots, self.question), *problem]

    def step(self, model_turn_text: str) -> StepResult:
        self.turns += 1
        turn = parse_tool_calls(model_turn_text, id_prefix=f"call_t{self.turns}")
        self.counts["malformed_calls"] += len(turn.errors)
        if ANSWER_MARKER in turn.content:
            answer, formatted = parse_answer(turn.content)
            correct = bool(formatted and answer is not None and answer == self.answer)
            return self._end(1.0 if correct else 0.0, correct, answer)
        if self.turns >= self.max_turns:
            return self._end(0.0, False, None)
        replies, reward = [], 0.0
        for call in turn.calls[: self.max_calls_per_turn]:
            result = TOOLBOX.run(call)
            if result.ok and self.counts["valid_calls"] == 0:
                reward = self.call_bonus
            self.counts["valid_calls" if result.ok else "failed_calls"] += 1
            replies.append(tool_message(call, result.content))
        if turn.errors:
            how = '<tool_call>{"name": "calculate", "arguments": {"expression": "..."}}</tool_call>'
            replies.append(
                {
                    "role": "user",
                    "content": "Could not read your tool call: " + "; ".join(turn.errors) + f". Write {how}.",
                }
            )
        if not replies:
            reminder = f"Call the calculate tool, or give the final answer as '{ANSWER_MARKER} <number>'."
            replies.append({"role": "user", "content": reminder})
        return StepResult(replies, reward=reward)

    def _end(self, reward: float, correct: bool, answer: float | None) -> StepResult:
        tool_use = {
            **self.counts,
            "turns": self.turns,
            "correct": correct,
            "tool_use_success": correct and self.counts["valid_calls"] > 0,
        }
        if self.episode_log:
            line = json.dumps({"time": time.time(), "prompt_id": self.prompt_id, **tool_use}) + "\n"
            with _LOG_LOCK, open(self.episode_log, "a") as log:
                log.write(line)
        return StepResult([], reward=reward, done=True, info={"answer": answer, "tool_use": tool_use})


def summarize(path: str | Path, share: float = 0.2) -> dict[str, dict[str, float]]:
    """Means of an episode log's fields over its first and its last `share` of episodes (in the order written):
    {"first": {...}, "last": {...}, "all": {...}}, each with `episodes` and the mean of every count and flag."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no episodes logged")
    k = max(1, round(len(rows) * share))
    keys = ("valid_calls", "failed_calls", "malformed_calls", "correct", "tool_use_success")

    def means(part: list[dict[str, Any]]) -> dict[str, float]:
        return {"episodes": len(part), **{key: sum(float(r[key]) for r in part) / len(part) for key in keys}}

    return {"first": means(rows[:k]), "last": means(rows[-k:]), "all": means(rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Summarise a tool_calculator episode log (first vs last 20%).")
    parser.add_argument("--summary", required=True, help="the env's episode_log file")
    args = parser.parse_args(argv)
    for part, values in summarize(args.summary).items():
        print(part, " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
