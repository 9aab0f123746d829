"""A number-guessing game: the model guesses, the environment answers "higher" or "lower", until it finds the number.

    [env]
    kind = "file"
    source = "examples/envs/data/guessing.jsonl"       # python -m examples.envs.guessing --write <that path>
    environment = "examples.envs.guessing:GuessingEnv"

Each prompt fixes a secret in `[low, high]` (its metadata: `secret`, `low`, `high`; the model never sees them but
for the range). Each model turn should hold a guess: the last integer in its text. The environment answers
"Higher." / "Lower." (or asks again for a turn without a number in range), until:
  * the guess is right: done, reward `1 - 0.5 * (guesses - 1) / (max_guesses - 1)`: 1.0 at the first guess, 0.5 at
    the last allowed one: finding it matters most, fewer turns are better;
  * `max_guesses` turns have passed: done, reward 0.
A turn without a valid guess costs `invalid_penalty` (a per-turn reward). Binary search over [1, 100] needs at most
7 guesses; `max_guesses` defaults to 10 (keep `env.max_turns` >= it).
"""

from __future__ import annotations

import random
import re
import sys
from typing import Any

from common.envs import StepResult
from common.tasks import PromptRecord

INTEGER = re.compile(r"-?\d+")


class GuessingEnv:
    """One game (see the module docstring)."""

    def __init__(self, max_guesses: int = 10, invalid_penalty: float = 0.1) -> None:
        if max_guesses < 2:
            raise ValueError(f"max_guesses must be >= 2, got {max_guesses}")
        self.max_guesses = max_guesses
        self.invalid_penalty = invalid_penalty

    def reset(self, task: Any) -> list[dict[str, str]]:
        self.secret, self.low, self.high = (int(task.metadata[k]) for k in ("secret", "low", "high"))
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"secret {self.secret} outside [{self.low}, {self.high}]")
        self.turns = 0
        return list(task.messages)

    def step(self, model_turn_text: str) -> StepResult:
        self.turns += 1
        numbers = INTEGER.findall(model_turn_text)
        guess = int(numbers[-1]) if numbers else None
        if guess == self.secret:
            reward = 1.0 - 0.5 * (self.turns - 1) / (self.max_guesses - 1)
            return StepResult([], reward=reward, done=True, info={"guesses": self.turns})
        if self.turns >= self.max_guesses:
            return StepResult([], reward=0.0, done=True, info={"guesses": self.turns})
        if guess is None or not self.low <= guess <= self.high:
            ask = f"Please answer with a single whole number between {self.low} and {self.high}."
            return StepResult([{"role": "user", "content": ask}], reward=-self.invalid_penalty)
        hint = "Higher." if guess < self.secret else "Lower."
        return StepResult([{"role": "user", "content": hint}], reward=0.0)


def guessing_prompts(num_prompts: int, seed: int = 0) -> list[PromptRecord]:
    """Games over [1, 100] (and, one in four, [1, 1000]) with a secret drawn per prompt; reproducible for a seed."""
    rng = random.Random(f"tandem-guessing:{seed}")
    records = []
    for prompt_id in range(num_prompts):
        high = 1000 if rng.random() < 0.25 else 100
        text = (
            f"I am thinking of a whole number between 1 and {high}. Guess it: answer with just a number, and I "
            "will tell you whether my number is higher or lower."
        )
        records.append(
            PromptRecord(
                prompt_id=prompt_id,
                messages=[{"role": "user", "content": text}],
                metadata={"secret": rng.randint(1, high), "low": 1, "high": high},
            )
        )
    return records


if __name__ == "__main__":
    from examples.envs.prompt_sets import main

    sys.exit(main(guessing_prompts, default_count=256))
