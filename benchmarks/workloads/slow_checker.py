"""Workload C of benchmarks/time_to_accuracy: multi-turn episodes whose tool takes heavy-tailed time.

    [env]
    kind = "word_problems"
    environment = "slow_checker:SlowCheckerEnv"      # from this folder (env.plugin_paths starts at the config's)
    environment_args = { median_s = 0.5, p99_s = 10.0, attempts = 2 }

The model answers a word problem; the environment hands the answer to a checker (the slow tool: a sandbox that runs
tests, a grader, a web call) and the checker's verdict comes back as the next turn. A right answer ends the episode
with reward 1 on the first attempt and `retry_reward` (0.5) on a later one; a wrong one gets a user message saying
so and asking again, until `attempts` answers were checked (reward 0). What is learned is the first answer's
accuracy, which evaluation measures on held-out questions in one turn (eval set `word_problems-d2`), so workload C
trains on the same skill as A and B and is measured the same way; only the episode's shape and its tool differ.

The checker's time: log-normal, as service and sandbox latencies are, with median `median_s` and 99th percentile
`p99_s` (so sigma = ln(p99_s / median_s) / z_0.99 with z_0.99 = 2.3263: 0.5 s and 10 s give sigma = 1.288, a mean
of 1.15 s, 1% of calls over 10 s and 0.1% over 26 s), capped at `cap_s` (50 s: P(over) = 1e-4 at these values)
so that a draw never outlives env.step_timeout_s. The wait is `asyncio.sleep`: the tool costs wall time, not CPU,
as a remote tool does. Draws come from one generator per process, seeded by `seed` (the generator's
`prepare` call), so runs with the same seed see the same sequence of latencies in the order calls are made.

Scoring: common.math_reward (the verifier `env.reward_fn = "math"` uses): the answer after '####', in \\boxed{} or
"the answer is", else the last number, against the reference's `#### n`. The reward is split into components
`first_try` (1 when the first answer was right) and `retry` (retry_reward when a later one was), which sum to it
and reach the learner as reward/first_try and reward/retry.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from common.envs import StepResult, Task
from common.math_reward import math_reward
from common.tasks import ANSWER_MARKER

Z_99 = 2.326347874  # the standard normal's 99th percentile
RETRY = (
    "The checker ran your answer: it is wrong. Check each step of your solution and answer again, ending with "
    f"'{ANSWER_MARKER} <number>'."
)
_rng = random.Random(0)


def lognormal_sigma(median_s: float, p99_s: float) -> float:
    """The sigma of a log-normal with this median and 99th percentile."""
    return math.log(p99_s / median_s) / Z_99


class SlowCheckerEnv:
    """One episode (see the module docstring)."""

    @staticmethod
    def prepare(
        median_s: float = 0.5,
        p99_s: float = 10.0,
        cap_s: float = 50.0,
        attempts: int = 2,
        retry_reward: float = 0.5,
        seed: int = 0,
    ) -> None:
        """Checks the arguments at start-up and seeds this process's latency draws."""
        if not 0 < median_s < p99_s <= cap_s:
            raise ValueError(f"need 0 < median_s < p99_s <= cap_s, got {median_s}, {p99_s}, {cap_s}")
        if attempts < 1 or not 0 <= retry_reward <= 1:
            raise ValueError(f"need attempts >= 1 and 0 <= retry_reward <= 1, got {attempts}, {retry_reward}")
        _rng.seed(seed)

    def __init__(
        self,
        median_s: float = 0.5,
        p99_s: float = 10.0,
        cap_s: float = 50.0,
        attempts: int = 2,
        retry_reward: float = 0.5,
        seed: int = 0,
    ) -> None:
        self.mu, self.sigma, self.cap_s = math.log(median_s), lognormal_sigma(median_s, p99_s), cap_s
        self.attempts, self.retry_reward = attempts, retry_reward
        self.metadata: dict[str, Any] = {}
        self.checked = 0

    def latency_s(self) -> float:
        return min(self.cap_s, _rng.lognormvariate(self.mu, self.sigma))

    def reset(self, task: Task) -> list[dict[str, str]]:
        self.metadata, self.checked = dict(task.metadata), 0
        return list(task.messages)

    async def step(self, model_turn_text: str) -> StepResult:
        await asyncio.sleep(self.latency_s())  # the checker's time
        self.checked += 1
        right = math_reward(model_turn_text, self.metadata)["correct"] > 0
        if right or self.checked >= self.attempts:
            reward = (1.0 if self.checked == 1 else self.retry_reward) if right else 0.0
            first = right and self.checked == 1
            components = {"first_try": 1.0 if first else 0.0, "retry": reward if right and not first else 0.0}
            return StepResult([], reward=reward, done=True, info={"components": components})
        return StepResult([{"role": "user", "content": RETRY}])
