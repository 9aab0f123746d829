"""A Python coding task: the model writes a function, hidden tests run in a sandbox, failures come back as feedback.

    [env]
    kind = "file"
    source = "examples/envs/data/code.jsonl"           # python -m examples.envs.code_task --write <that path>
    environment = "examples.envs.code_task:CodeEnv"

Each prompt asks for one function (metadata: `function`, `cases`: a JSON list of [arguments, expected result]).
The model answers with a ```python block (or bare code with a `def`). The environment runs it in the sandbox
(`actors.environments.sandbox`: its own namespaces and private root, nobody with no capabilities, no network, time, memory,
disk and output limits, standard library only). Nothing that judges is in there: the sandboxed process gets only
the cases' ARGUMENTS, calls the function on each and prints what it returned (or raised) after a random marker;
the expected results, the count of cases and the comparison stay here, in the environment's process, where the
solution cannot reach. The solution runs in the same interpreter as that harness, so it can read the marker and
print a report of its own: such a report is only a claim about its own return values (which it controls anyway),
and it must hold exactly one well-formed outcome per case, in order, or every case fails ("the test report was
malformed"). So an empty, short, long or garbled report, a crash or an early exit scores 0, and the only way to a
pass is to return the expected values: the reward measures the function, not the printing. (Before, an empty
forged report passed every case: the comparison zipped the cases with however many outcomes came back.) Then:
  * every case passes: done, reward 1.0;
  * else the model gets the first failures (arguments, what it returned or raised, and for some what was expected)
    and tries again, up to `max_attempts`; after the last: done, reward = the share of the UNREVEALED cases passed
    by that last attempt.
Feedback never gives the answers away: a case whose expected value was shown is revealed and no longer scored, and
at most half of the cases are ever revealed (the other failures are shown without their expected value). So a
"solution" that computes nothing and replays the expected values of earlier feedback scores 0 (before, it passed
every case by its third attempt). A single attempt reveals nothing: its reward is the share of all cases passed.
The report is parsed bounded (`MAX_REPORT_CHARS`, values nested at most `MAX_DEPTH` deep): a deeper or larger one
is malformed and scores 0 with that reason, never a `RecursionError` in `step`.
A turn without code is asked for code (and counts as an attempt). The whole run of one attempt is bounded by
`time_limit_s` and `memory_mb`. Where the kernel grants the sandbox no namespaces, a step raises
`actors.environments.sandbox.SandboxUnavailable` unless `allow_audit_hook_only = true` is among the environment's arguments.
"""

from __future__ import annotations

import json
import random
import re
import secrets
import sys
from collections.abc import Callable
from typing import Any

from actors.environments.sandbox import SandboxLimits, SandboxResult, run_python
from common.envs import StepResult
from common.tasks import PromptRecord

MAX_REPORT_CHARS = 1 << 20  # the sandbox's output_bytes: a longer report cannot be the harness's
MAX_DEPTH = 32  # arrays/objects inside each other in a report; the tasks' values nest 2 deep
CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
HARNESS = """
import json, sys
MARKER = {marker!r}
cases = json.load(open("cases.json"))
try:
    import solution
    function = getattr(solution, {function!r})
except BaseException as error:
    print(MARKER + json.dumps({{"load_error": (type(error).__name__ + ": " + str(error))[:300]}}))
    sys.exit(0)
outputs = []
for arguments in cases:
    try:
        outputs.append({{"value": json.loads(json.dumps(function(*arguments), default=repr))}})
    except BaseException as error:
        outputs.append({{"error": (type(error).__name__ + ": " + str(error))[:200]}})
sys.stdout.write("\\n" + MARKER + json.dumps({{"outputs": outputs}}) + "\\n")
"""


def _canonical(value: Any) -> str:
    """Equal JSON text, so that True does not pass for 1 nor 1.0 for 1."""
    return json.dumps(value, sort_keys=True)


def extract_code(text: str) -> str | None:
    """The last fenced Python block of a model turn, else the whole turn if it defines a function, else None."""
    blocks = CODE_BLOCK.findall(text)
    if blocks:
        return blocks[-1]
    return text if "def " in text else None


def run_cases(code: str, function: str, cases: list[list[Any]], limits: SandboxLimits) -> list[dict[str, Any]]:
    """Call `function` of `code` on every case's arguments in the sandbox: one {"value"} or {"error"} per case."""
    marker = f"<<tandem-{secrets.token_hex(8)}>>"
    result = run_python(
        HARNESS.format(marker=marker, function=function),
        files={"solution.py": code, "cases.json": json.dumps([args for args, _ in cases])},
        limits=limits,
    )
    failure = _failure(result, limits)
    if failure is None:
        lines = [line for line in result.stdout.splitlines() if line.startswith(marker)]
        if not lines:
            last = result.stderr.strip().splitlines()[-1:] or ["no output"]
            failure = f"the program crashed: {last[0][:200]}"
        else:
            outputs = parse_report(lines[-1][len(marker) :], len(cases))
            if isinstance(outputs, list):
                return outputs
            failure = outputs
    return [{"error": failure}] * len(cases)


def _failure(result: SandboxResult, limits: SandboxLimits) -> str | None:
    """Why a run gave no report to read: a limit it hit, or None."""
    if result.timed_out:
        return f"timed out after {limits.time_s:g}s"
    if result.output_exceeded:
        return f"printed more than {limits.output_bytes} bytes"
    return None


def nested_deeper(text: str, limit: int) -> bool:
    """Whether the JSON `text` opens more than `limit` arrays/objects inside each other (brackets inside strings
    are skipped): checked before `json.loads`, whose recursion a deeply nested report would exhaust."""
    depth, in_string, escaped = 0, False, False
    for char in text:
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = char == "\\", char != '"'
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


def parse_report(text: str, count: int) -> list[dict[str, Any]] | str:
    """The harness's report, checked: exactly `count` outcomes, each {"value": JSON} or {"error": str}, or the
    load error. Anything else is the reason it was refused (a string): the report came from code under test, so
    it is judged as hostile input, never trusted for its shape, size or depth (a report over `MAX_REPORT_CHARS`
    or nested deeper than `MAX_DEPTH` is refused unread: parsing it would raise `RecursionError`)."""
    malformed = "the test report was malformed (the program printed over it, or exited before it)"
    if len(text) > MAX_REPORT_CHARS:
        return f"the test report was malformed (over {MAX_REPORT_CHARS} characters)"
    if nested_deeper(text, MAX_DEPTH):
        return f"the test report was malformed (values nested deeper than {MAX_DEPTH})"
    try:
        report = json.loads(text)
    except (ValueError, RecursionError):  # deliberately survived: the solution may print anything after the marker
        return malformed
    if isinstance(report, dict) and set(report) == {"load_error"} and isinstance(report["load_error"], str):
        return report["load_error"][:300]
    outputs = report.get("outputs") if isinstance(report, dict) and set(report) == {"outputs"} else None
    if not isinstance(outputs, list) or len(outputs) != count:
        return malformed
    for outcome in outputs:
        well_formed = isinstance(outcome, dict) and (
            set(outcome) == {"value"} or (set(outcome) == {"error"} and isinstance(outcome["error"], str))
        )
        if not well_formed:
            return malformed
    return [{"error": outcome["error"][:200]} if "error" in outcome else outcome for outcome in outputs]


class CodeEnv:
    """One coding episode (see the module docstring)."""

    def __init__(
        self,
        max_attempts: int = 3,
        time_limit_s: float = 5.0,
        memory_mb: int = 512,
        failures_shown: int = 3,
        allow_audit_hook_only: bool = False,
    ) -> None:
        self.max_attempts = max_attempts
        self.limits = SandboxLimits(
            time_s=time_limit_s, memory_mb=memory_mb, allow_audit_hook_only=allow_audit_hook_only
        )
        self.failures_shown = failures_shown

    def reset(self, task: Any) -> list[dict[str, str]]:
        self.function = str(task.metadata["function"])
        self.cases = json.loads(task.metadata["cases"])
        self.attempts = 0
        self.revealed: set[int] = set()  # cases whose expected value feedback has shown: no longer scored
        return list(task.messages)

    def step(self, model_turn_text: str) -> StepResult:
        self.attempts += 1
        last = self.attempts >= self.max_attempts
        code = extract_code(model_turn_text)
        if code is None:
            if last:
                return StepResult([], reward=0.0, done=True, info={"passed": 0})
            ask = f"Please write the function `{self.function}` in a ```python code block."
            return StepResult([{"role": "user", "content": ask}], reward=0.0)
        outputs = run_cases(code, self.function, self.cases, self.limits)
        failed = [
            i
            for i, ((_, expected), out) in enumerate(zip(self.cases, outputs))
            if "error" in out or _canonical(out["value"]) != _canonical(expected)
        ]
        passed = len(self.cases) - len(failed)
        if not failed or last:
            scored = self._unrevealed(self.revealed)
            reward = sum(i not in failed for i in scored) / len(scored)
            return StepResult([], reward=reward, done=True, info={"passed": passed})
        return StepResult([{"role": "user", "content": self._feedback(failed, outputs, passed)}], reward=0.0)

    def _unrevealed(self, revealed: set[int]) -> list[int]:
        """The cases scored: those whose arguments no revealed case shares (a repeated case is revealed too)."""
        shown = {_canonical(self.cases[i][0]) for i in revealed}
        return [i for i, (args, _) in enumerate(self.cases) if _canonical(args) not in shown]

    def _feedback(self, failed: list[int], outputs: list[dict[str, Any]], passed: int) -> str:
        """The first `failures_shown` failures; the expected value only of cases already revealed, or while at
        least half the cases stay unrevealed (those become revealed: the reward no longer counts them)."""
        lines = [f"{passed} of {len(self.cases)} tests passed. Failures:"]
        for i in failed[: self.failures_shown]:
            args, expected = self.cases[i]
            out = outputs[i]
            got = f"raised {out['error']}" if "error" in out else f"returned {repr(out['value'])[:200]}"
            if i not in self.revealed and 2 * len(self._unrevealed(self.revealed | {i})) >= len(self.cases):
                self.revealed.add(i)
            shown = f"expected {expected!r}" if i in self.revealed else "a hidden test: its expected value is not shown"
            lines.append(f"- {self.function}({', '.join(map(repr, args))}) {got}, {shown}")
        lines.append("Fix the function and reply with the whole corrected code.")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the task set
def _words(rng: random.Random) -> str:
    return " ".join(
        rng.choice(["red", "fox", "jumps", "over", "a", "lazy", "dog", "sky", "blue"]) for _ in range(rng.randint(1, 6))
    )


def _palindrome_candidate(rng: random.Random) -> str:
    half = "".join(rng.choice("abcAB ,") for _ in range(rng.randint(0, 4)))
    return half + half[::-1] if rng.random() < 0.5 else half + rng.choice("xyz") + half


def _fizzbuzz(n: int) -> str:
    return "FizzBuzz" if n % 15 == 0 else "Fizz" if n % 3 == 0 else "Buzz" if n % 5 == 0 else str(n)


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


# name -> (signature, description, reference, arguments generator)
PROBLEMS: dict[str, tuple[str, str, Callable[..., Any], Callable[[random.Random], list[Any]]]] = {
    "reverse_words": (
        "reverse_words(text: str) -> str",
        "returns the words of `text` in reverse order, joined by single spaces",
        lambda t: " ".join(t.split()[::-1]),
        lambda r: [_words(r)],
    ),
    "is_palindrome": (
        "is_palindrome(text: str) -> bool",
        "tells whether `text` reads the same backwards, ignoring case and any character that is not a letter or digit",
        lambda t: (s := [c.lower() for c in t if c.isalnum()]) == s[::-1],
        lambda r: [_palindrome_candidate(r)],
    ),
    "gcd": (
        "gcd(a: int, b: int) -> int",
        "returns the greatest common divisor of two non-negative integers (gcd(0, 0) = 0)",
        _gcd,
        lambda r: [r.randint(0, 500), r.randint(0, 500)],
    ),
    "running_sum": (
        "running_sum(numbers: list[int]) -> list[int]",
        "returns the running totals of `numbers`",
        lambda xs: [sum(xs[: i + 1]) for i in range(len(xs))],
        lambda r: [[r.randint(-9, 9) for _ in range(r.randint(0, 6))]],
    ),
    "count_vowels": (
        "count_vowels(text: str) -> int",
        "counts the vowels a, e, i, o, u in `text`, in either case",
        lambda t: sum(c in "aeiouAEIOU" for c in t),
        lambda r: [_words(r).title()],
    ),
    "fizzbuzz": (
        "fizzbuzz(n: int) -> str",
        "returns 'FizzBuzz' if n is divisible by 15, 'Fizz' by 3, 'Buzz' by 5, else str(n)",
        _fizzbuzz,
        lambda r: [r.randint(1, 100)],
    ),
    "second_largest": (
        "second_largest(numbers: list[int]) -> int",
        "returns the second largest DISTINCT value of `numbers` (which has at least two distinct values)",
        lambda xs: sorted(set(xs))[-2],
        lambda r: [r.sample(range(-20, 20), r.randint(2, 6)) * r.randint(1, 2)],
    ),
    "to_binary": (
        "to_binary(n: int) -> str",
        "returns the binary digits of a non-negative integer, without a prefix ('0' for 0)",
        lambda n: format(n, "b"),
        lambda r: [r.randint(0, 300)],
    ),
    "flatten": (
        "flatten(lists: list[list[int]]) -> list[int]",
        "concatenates the lists in order",
        lambda xss: [x for xs in xss for x in xs],
        lambda r: [[[r.randint(0, 9) for _ in range(r.randint(0, 3))] for _ in range(r.randint(0, 4))]],
    ),
    "is_prime": (
        "is_prime(n: int) -> bool",
        "tells whether the integer n is a prime number",
        _is_prime,
        lambda r: [r.randint(-3, 120)],
    ),
    "digit_sum": (
        "digit_sum(n: int) -> int",
        "returns the sum of the decimal digits of |n|",
        lambda n: sum(int(d) for d in str(abs(n))),
        lambda r: [r.randint(-(10**6), 10**6)],
    ),
}


def code_prompts(num_prompts: int, seed: int = 0, cases_per_task: int = 6) -> list[PromptRecord]:
    """Prompts cycling through `PROBLEMS`, each with `cases_per_task` cases drawn from the problem's generator and
    answered by its reference implementation. Reproducible for a seed; prompt_id = index."""
    rng = random.Random(f"tandem-code:{seed}")
    names = sorted(PROBLEMS)
    records = []
    for prompt_id in range(num_prompts):
        name = names[prompt_id % len(names)]
        signature, description, reference, arguments = PROBLEMS[name]
        cases = [[args, reference(*args)] for args in (arguments(rng) for _ in range(cases_per_task))]
        text = (
            f"Write a Python function `{signature}` that {description}. Use only the standard library. "
            "Reply with the code in a ```python block."
        )
        records.append(
            PromptRecord(
                prompt_id=prompt_id,
                messages=[{"role": "user", "content": text}],
                metadata={"function": name, "cases": json.dumps(cases)},
            )
        )
    return records


if __name__ == "__main__":
    from examples.envs.prompt_sets import main

    sys.exit(main(code_prompts, default_count=110))
