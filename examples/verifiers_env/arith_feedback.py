"""arith-feedback: a verifiers (0.4, `verifiers.v1`) environment written as for `vf-eval`, run unchanged by Tandem.

Sums of two small numbers, answered in up to `max_attempts` turns: after a wrong answer the env says so and asks
again. It uses the pieces a verifiers author writes: a `Taskset` (the data: `load` yields one `Task` per row), a
`Task` with its rubric (`@vf.reward` methods, weighted, and a `@vf.metric`), and an `Env` subclass whose `run`
drives the multi-turn protocol through the agent's interaction (`turn(message)` -> the model's reply).

    [env]
    environment = "verifiers:arith-feedback"      # a verifiers id: the module arith_feedback, found on plugin_paths
    plugin_paths = ["verifiers_env"]
    kind = "file"
    source = "verifiers_env/data/arith_feedback.jsonl"
    # python -m actors.environments.verifiers_env --export arith-feedback examples/verifiers_env/data/arith_feedback.jsonl \
    #     --path examples/verifiers_env

Rewards (the episode's reward is their weighted sum; Tandem reports each as a component):
  * correct (weight 1): 1.0 when the first answer is right, 0.5 when the second is, 0.25 the third, else 0;
  * bare_number (weight 0.5): the fraction of the model's replies that are just an integer (the answer format).
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

BARE_INTEGER = re.compile(r"^\s*-?\d+\s*\.?\s*$")
INTEGER = re.compile(r"-?\d+")
RETRY = "Not quite. Try again: reply with just the number."


def answer_of(reply: str) -> int | None:
    """The integer a reply gives: its last one (None without any)."""
    found = INTEGER.findall(reply)
    return int(found[-1]) if found else None


class ArithData(vf.TaskData):
    answer: int


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        for attempt, message in enumerate(trace.assistant_messages):
            if answer_of(message.content or "") == self.data.answer:
                return 0.5**attempt
        return 0.0

    @vf.reward(weight=0.5)
    async def bare_number(self, trace: vf.Trace) -> float:
        replies = trace.assistant_messages
        return sum(bool(BARE_INTEGER.match(m.content or "")) for m in replies) / len(replies) if replies else 0.0

    @vf.metric
    async def attempts(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


class ArithConfig(vf.TasksetConfig):
    num_tasks: int = 200
    """How many sums to build."""
    seed: int = 0
    high: int = 20
    """Each addend is in [1, high]."""


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> list[ArithTask]:
        rng = random.Random(self.config.seed)
        tasks = []
        for i in range(self.config.num_tasks):
            a, b = rng.randint(1, self.config.high), rng.randint(1, self.config.high)
            data = ArithData(id=f"sum-{i}", prompt=f"What is {a} + {b}? Reply with just the number.", answer=a + b)
            tasks.append(ArithTask(data, self.config.task))
        return tasks


class ArithEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"})
    """The one seat, on verifiers' tool-less chat harness (under Tandem the policy plays it directly)."""
    max_attempts: int = 3


class ArithEnv(vf.Env[ArithEnvConfig]):
    async def run(self, task: ArithTask, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(self.config.max_attempts - 1):
                if segment.terminated or answer_of(segment.last_reply) == task.data.answer:
                    return
                segment = await chat.turn(RETRY)


__all__ = ["ArithEnv", "ArithTaskset"]
