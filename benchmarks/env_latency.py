"""Engine utilisation and samples/s of multi-turn episodes whose environment takes 0, 50 or 500 ms a step.

    .venv/bin/python -m benchmarks.env_latency [--seconds 6] [--turns 3]

SIMULATION engine (`actors.engine.simulated.SimEngine`: a step costs `--token-s` whatever the batch, `--tokens` tokens a
turn), the production episode driver (`actors.environments.episodes.EpisodeDriver`) and environment runner
(`actors.environments.runner.EnvRunner`), driven by the generator's loop in miniature: take in finished environment calls,
add the queued turns, one engine step (or wait for an environment when the engine has nothing to run). Each episode
takes `--turns` model turns; every step of its environment sleeps the latency (a plain function: a tool call, a
sandboxed test run, a remote service). Episodes are kept in flight at a fixed count (a finished group is replaced
at once, as the generator leases ahead) for `--seconds` per configuration.

Reported per configuration: samples/s (finished episodes), model tokens/s, and engine utilisation = the share of
wall time spent in engine steps (the rest: waiting for environments with nothing to sample, plus the driver's own
bookkeeping). By Little's law a slow environment needs more episodes in flight to keep the engine busy:
samples/s <= in_flight / episode time. Compared with `blocking`: the same driver with every
environment call run inline on the engine's thread (what a loop that calls `env.step` directly does).
Writes results/env_latency.{json,png}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import random
import time
from typing import Any

from actors.engine.simulated import SimEngine
from actors.environments.episodes import EpisodeDriver, EpisodeLimits
from actors.environments.runner import CallOutcome, EnvCall, EnvRunner
from benchmarks.common import save
from common.envs import StepResult
from common.types import PromptItem

LATENCIES_S = (0.0, 0.05, 0.5)
IN_FLIGHT = (16, 64, 256, 1024)
GROUP_SIZE = 8


class LatencyEnv:
    """`turns` steps, each sleeping `latency_s` +-50% (uniform: real tools vary); done at the last (reward 1)."""

    def __init__(self, latency_s: float, turns: int, seed: int) -> None:
        self.latency_s, self.turns, self.taken = latency_s, turns, 0
        self.rng = random.Random(seed)

    def reset(self, task: Any) -> list[dict[str, str]]:
        return list(task.messages)

    def step(self, text: str) -> StepResult:
        time.sleep(self.latency_s * self.rng.uniform(0.5, 1.5))
        self.taken += 1
        if self.taken >= self.turns:
            return StepResult([], reward=1.0, done=True)
        return StepResult([{"role": "user", "content": "Result: 42. Continue."}])


class InlineRunner:
    """The baseline: runs each environment call at once, on the caller's (the engine's) thread."""

    stuck_calls = 0

    def call(self, fn: Any, *args: Any, timeout_s: float) -> EnvCall:
        future: concurrent.futures.Future = concurrent.futures.Future()
        started = time.monotonic()
        try:
            future.set_result(CallOutcome(value=fn(*args), seconds=time.monotonic() - started))
        except Exception as error:  # noqa: BLE001 - recorded like the real runner does
            future.set_result(CallOutcome(error=f"{type(error).__name__}: {error}"))
        return EnvCall(future)

    def wait(self, timeout_s: float) -> None:
        time.sleep(timeout_s)

    def close(self) -> None:
        pass


def run_config(latency_s: float, in_flight: int, blocking: bool, args: argparse.Namespace) -> dict[str, float]:
    engine = SimEngine(args.tokens, args.token_s, max_num_seqs=4096, seed=0)
    runner: Any = InlineRunner() if blocking else EnvRunner(workers=in_flight)
    limits = EpisodeLimits(
        max_turns=args.turns,
        max_total_tokens=100_000,
        turn_max_tokens=args.tokens,
        max_model_len=1_000_000,
        step_timeout_s=60,
        episode_timeout_s=600,
        failure_reward=0,
    )
    seeds = itertools.count()
    driver = EpisodeDriver(engine, lambda: LatencyEnv(latency_s, args.turns, next(seeds)), limits, runner, GROUP_SIZE)
    task = PromptItem(0, 0, [{"role": "user", "content": "Solve the task with the tool."}], {})
    next_prompt, samples, busy_s = 0, 0, 0.0
    started = time.monotonic()
    deadline = started + args.seconds
    while time.monotonic() < deadline:
        while len(driver.groups) * GROUP_SIZE < in_flight:
            driver.start_group(0, PromptItem(next_prompt, 0, task.messages, {}))
            next_prompt += 1
        samples += sum(len(group.results) for group in driver.advance())
        if engine.num_unfinished():
            step_started = time.monotonic()
            finished = engine.step()
            busy_s += time.monotonic() - step_started
            for sample in finished:
                driver.on_turn(sample)
        else:
            driver.wait(0.002)
    elapsed = time.monotonic() - started
    runner.close()
    turns = driver.stats.turns
    return {
        "latency_ms": latency_s * 1000,
        "in_flight": in_flight,
        "mode": "blocking" if blocking else "concurrent",
        "samples_per_s": samples / elapsed,
        "model_tokens_per_s": driver.stats.model_tokens / elapsed,
        "env_steps_per_s": len(driver.stats.step_seconds) / elapsed,
        "engine_utilisation": busy_s / elapsed,
        "episodes": samples,
        "turns_mean": sum(turns) / len(turns) if turns else 0.0,
    }


def plot(rows: list[dict[str, Any]]) -> Any:
    def draw(axes: Any) -> None:
        for label, selected in [
            (f"concurrent, {n} in flight", [r for r in rows if r["mode"] == "concurrent" and r["in_flight"] == n])
            for n in IN_FLIGHT
        ] + [("blocking, 64 in flight", [r for r in rows if r["mode"] == "blocking"])]:
            x = [str(int(r["latency_ms"])) for r in selected]
            y = [r["model_tokens_per_s"] for r in selected]
            axes.plot(x, y, marker="o", label=label, linestyle="--" if "blocking" in label else "-")
            for xi, yi, r in zip(x, y, selected):
                axes.annotate(
                    f"{r['engine_utilisation']:.0%}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7
                )
        axes.set_xlabel("environment latency per step (ms)")
        axes.set_ylabel("model tokens / s (sampled turns)")
        axes.set_yscale("log")
        axes.set_title("SIMULATION engine, 3-turn episodes: throughput (labels: engine utilisation)", fontsize=9)
        axes.legend(fontsize=7)

    return draw


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The figures issues quote, per environment latency: the engine's best utilisation with concurrent
    environment calls (over the in-flight counts tried), and with blocking calls."""
    figures: dict[str, Any] = {}
    for row in result["results"]:
        key = f"{row['mode']}_utilisation_{row['latency_ms']:.0f}ms"
        figures[key] = max(figures.get(key, 0.0), row["engine_utilisation"])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="wall time per configuration")
    parser.add_argument("--turns", type=int, default=3, help="model turns (and environment steps) per episode")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per model turn")
    parser.add_argument("--token-s", type=float, default=0.002, help="seconds per engine step (SIMULATION)")
    args = parser.parse_args()
    rows = []
    for latency in LATENCIES_S:
        for in_flight in IN_FLIGHT:
            rows.append(run_config(latency, in_flight, blocking=False, args=args))
            print(rows[-1])
        rows.append(run_config(latency, 64, blocking=True, args=args))
        print(rows[-1])
    print(
        f"\n{'latency':>8} {'mode':>11} {'in flight':>9} {'samples/s':>10} {'env steps/s':>11} {'tokens/s':>9} "
        f"{'engine busy':>11}"
    )
    for r in rows:
        print(
            f"{r['latency_ms']:>6.0f}ms {r['mode']:>11} {r['in_flight']:>9} {r['samples_per_s']:>10.1f} "
            f"{r['env_steps_per_s']:>11.1f} {r['model_tokens_per_s']:>9.0f} {r['engine_utilisation']:>10.0%}"
        )
    result = {"engine": "SIMULATION (actors.engine.simulated.SimEngine)", "settings": vars(args), "results": rows}
    save("env_latency", {"headline": headline(result), **result}, plot(rows))


if __name__ == "__main__":
    main()
