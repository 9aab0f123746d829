"""A calculator tool environment: the model may call a calculator before it answers an arithmetic word problem.

    [env]
    kind = "file"
    source = "examples/envs/data/calculator.jsonl"     # python -m examples.envs.calculator --write <that path>
    environment = "examples.envs.calculator:CalculatorEnv"

Tool syntax (told to the model in the system prompt): anywhere in its turn the model writes
`<calc>EXPRESSION</calc>`, where EXPRESSION uses numbers, `+ - * /` and parentheses. The environment answers with one
message holding `<result>VALUE</result>` (or `<error>WHY</error>`) for each call, in order (at most
`max_calls_per_turn`). A turn with `#### ANSWER` ends the episode.

Rewards: terminal 1.0 when the answer after `####` equals the task's answer, else 0.0; each turn that neither calls
the calculator nor answers costs `idle_penalty` (a per-turn reward). The environment ends the episode after
`max_turns` turns of its own too (reward 0 for the last), so it also works with a larger `env.max_turns`.

Safety: EXPRESSION is never evaluated by Python. `evaluate` parses it into a syntax tree and walks it, accepting only
number literals, the four operators and unary signs, with exact rational arithmetic and limits on the text length,
the tree size and the magnitude of every intermediate value.
"""

from __future__ import annotations

import ast
import random
import re
import sys
from fractions import Fraction
from typing import Any

from common.envs import StepResult
from common.tasks import ANSWER_MARKER, PromptRecord, parse_answer

MAX_EXPRESSION_CHARS = 200
MAX_NODES = 64
MAX_MAGNITUDE = 10**18
CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
SYSTEM = (
    "You solve arithmetic problems. You may use a calculator: write <calc>expression</calc> with numbers, "
    "+ - * / and parentheses, and you will get <result>value</result>. When you know the answer, "
    f"write '{ANSWER_MARKER} <answer>'."
)


class CalcError(ValueError):
    """An expression the calculator refuses; the message is shown to the model."""


_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def evaluate(expression: str) -> Fraction:
    """The exact value of a calculator expression; CalcError (saying why) for anything else or beyond the limits."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError("not an expression of numbers, + - * / and parentheses") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"expression with more than {MAX_NODES} parts")
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalcError("division by zero")
        value = _OPERATORS[type(node.op)](left, right)
    else:
        raise CalcError(f"'{ast.unparse(node)[:40]}' is not allowed: only numbers, + - * / and parentheses")
    if abs(value.numerator) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
        raise CalcError("number too large")
    return value


def format_value(value: Fraction) -> str:
    """An integer as itself, anything else as a decimal with up to 10 digits after the point."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10f}".rstrip("0").rstrip(".")


class CalculatorEnv:
    """One episode of a calculator-assisted word problem (see the module docstring)."""

    def __init__(self, max_calls_per_turn: int = 3, idle_penalty: float = 0.05, max_turns: int = 6) -> None:
        self.max_calls_per_turn = max_calls_per_turn
        self.idle_penalty = idle_penalty
        self.max_turns = max_turns

    def reset(self, task: Any) -> list[dict[str, str]]:
        self.answer = int(task.metadata["answer"])
        self.turns = 0
        return [{"role": "system", "content": SYSTEM}, *task.messages]

    def step(self, model_turn_text: str) -> StepResult:
        self.turns += 1
        if ANSWER_MARKER in model_turn_text:
            answer, formatted = parse_answer(model_turn_text)
            correct = formatted and answer is not None and answer == self.answer
            return StepResult([], reward=1.0 if correct else 0.0, done=True, info={"answer": answer})
        if self.turns >= self.max_turns:
            return StepResult([], reward=0.0, done=True, info={"answer": None})
        calls = CALL.findall(model_turn_text)[: self.max_calls_per_turn]
        if not calls:
            reminder = f"Use <calc>expression</calc> to calculate, or give the answer as '{ANSWER_MARKER} <answer>'."
            return StepResult([{"role": "user", "content": reminder}], reward=-self.idle_penalty)
        results = []
        for expression in calls:
            try:
                results.append(f"<result>{format_value(evaluate(expression))}</result>")
            except CalcError as error:
                results.append(f"<error>{error}</error>")
        return StepResult([{"role": "user", "content": "\n".join(results)}], reward=0.0)


def calculator_prompts(num_prompts: int, seed: int = 0) -> list[PromptRecord]:
    """Word problems whose arithmetic is beyond mental math for a small model (3-digit products, sums of products);
    metadata: `answer` (int) and `expression`. Reproducible for a seed; prompt_id = index."""
    rng = random.Random(f"tandem-calculator:{seed}")
    templates = [
        (
            "A shop sells {a} boxes with {b} pencils each and {c} loose pencils. How many pencils are there?",
            "{a} * {b} + {c}",
        ),
        (
            "A train travels {a} km every day for {b} days, then {c} km more. How far does it travel in total?",
            "{a} * {b} + {c}",
        ),
        ("A farm has {a} rows of {b} trees; {c} trees are cut down. How many trees are left?", "{a} * {b} - {c}"),
        (
            "{a} people each pay {b} dollars, and {c} dollars of it go to fees. How much money is left?",
            "{a} * {b} - {c}",
        ),
        ("A printer prints {a} pages a minute for {b} minutes, twice. How many pages in total?", "{a} * {b} * 2"),
    ]
    records = []
    for prompt_id in range(num_prompts):
        text, expression = rng.choice(templates)
        values = {"a": rng.randint(12, 999), "b": rng.randint(12, 99), "c": rng.randint(1, 999)}
        expression = expression.format(**values)
        records.append(
            PromptRecord(
                prompt_id=prompt_id,
                messages=[{"role": "user", "content": text.format(**values)}],
                metadata={"answer": int(evaluate(expression)), "expression": expression},
            )
        )
    return records


if __name__ == "__main__":
    from examples.envs.prompt_sets import main

    sys.exit(main(calculator_prompts, default_count=256))
