"""How a leased prompt becomes a `RolloutGroup`: the generator's one seam for single- and multi-turn rollouts.

    make_rollouts = rollouts_maker(config, generator_id)   # resolves the reward function or environment now
    rollouts = make_rollouts(engine)                       # SingleTurnRollouts, or EpisodeRollouts (env.environment)
    rollouts.start(lease_id, prompt)                       # its n samples (or episodes) begin
    rollouts.advance(submit=True)                          # background work in, queued engine requests out
    for sample in engine.step(): rollouts.on_sample(sample)
    for group in rollouts.finished(now): outbox.add(group)  # scored and built, each once

A single-turn task is a one-step environment: the model's one turn is the whole episode and its reward is the
reward function's (and the reward model's). `SingleTurnRollouts` runs it without the episode machinery (no
environment object or worker thread per sample, the group scored at once, a learned reward model included), which
keeps the engine's throughput (`benchmarks/generator_throughput`); `EpisodeRollouts` runs every other environment
through `actors.environments.episodes`. The generator (`actors.generator`) drives both the same way and keeps no branch of its
own; evaluation requests (`actors.evaluation`) are the engine's other client.

One rule for a failure, both kinds: a sample whose reward cannot be had (its reward function raised or returned
garbage, its environment raised, overran or broke the contract) keeps its tokens, gets `env.failure_reward`, is
counted, and its finish reason says why: `env_error: <where>: ...` (or `env_timeout`, `episode_timeout`). A learned
reward model that could not score falls back per source instead (`actors.rewards.groups`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from actors.engine.api import Engine, FinishedSample
from actors.environments.episodes import EpisodeDriver, EpisodeLimits
from actors.environments.trajectory import build_episode_group
from actors.groups import PendingGroup, PendingGroups, build_group, sample_request_id
from actors.rewards.failure_guard import guarded
from actors.rewards.groups import GroupRewards
from common.config import TandemConfig
from common.types import PromptItem, RolloutGroup

log = logging.getLogger("tandem.actors.rollouts")


class Rollouts(Protocol):
    """What the generator's loop calls (module docstring). One thread; every method returns without blocking but
    `wait`."""

    def start(self, lease_id: int, prompt: PromptItem) -> bool:
        """Begin the prompt's `n` samples; False when it cannot run (counted, logged): the caller gives it up."""
        ...

    def on_sample(self, sample: FinishedSample) -> None:
        """A finished engine request of these rollouts (others' are ignored)."""
        ...

    def advance(self, submit: bool) -> None:
        """Take in background work (environment calls); add queued engine requests when `submit` (False while the
        generator drains the engine for a weights load)."""
        ...

    def finished(self, now: float) -> list[RolloutGroup]:
        """The groups completed and scored since the last call, each once."""
        ...

    def active(self) -> bool:
        """Some prompt started here has not come back from `finished`."""
        ...

    def background(self) -> bool:
        """Work runs off the loop (an environment call): `wait` wakes when it finishes."""
        ...

    def wait(self, timeout_s: float) -> None: ...

    def request_ids(self) -> list[str]:
        """The engine requests these rollouts are waiting on (what to abort on exit)."""
        ...

    def metrics(self) -> dict[str, float]: ...

    def progress(self) -> int:
        """Work done off the engine so far (environment calls answered; 0 for single-turn): with the engine steps,
        the progress a generator's heartbeat reports (actors.liveness)."""
        ...

    def close(self) -> None: ...


class SingleTurnRollouts:
    """One model turn per sample, the group scored by `GroupRewards` once its `n` samples are back."""

    def __init__(
        self, engine: Engine, rewards: GroupRewards, group_size: int, max_model_len: int, generator_id: int
    ) -> None:
        self.engine, self.rewards = engine, rewards
        self.group_size, self.max_model_len, self.generator_id = group_size, max_model_len, generator_id
        self.pending = PendingGroups(group_size)
        self.scoring: dict[tuple[int, int], PendingGroup] = {}  # (lease, prompt) -> group waiting for its rewards
        self.prompts_too_long = 0

    def start(self, lease_id: int, prompt: PromptItem) -> bool:
        tokens = self.engine.render(prompt)
        if len(tokens) >= self.max_model_len:
            self.prompts_too_long += 1
            log.error(
                "prompt %d has %d tokens, model.max_model_len is %d: skipped (raise model.max_model_len)",
                prompt.prompt_id,
                len(tokens),
                self.max_model_len,
            )
            return False
        self.pending.start(lease_id, prompt, tokens)
        for i in range(self.group_size):
            self.engine.add(sample_request_id(lease_id, prompt.prompt_id, i), tokens)
        return True

    def on_sample(self, sample: FinishedSample) -> None:
        pending = self.pending.record(sample)
        if pending is None:
            return
        prompt = pending.prompt
        texts = [self.engine.decode(s.completion_tokens) for s in pending.samples]
        key = (pending.lease_id, prompt.prompt_id)
        self.scoring[key] = pending
        self.rewards.submit(key, prompt.messages, texts, prompt.metadata, time.monotonic())

    def advance(self, submit: bool) -> None:
        """Nothing runs off the loop here: every request is added in `start`, scores are collected in `finished`."""

    def finished(self, now: float) -> list[RolloutGroup]:
        return [
            build_group(self.scoring.pop(key), scores, self.generator_id) for key, scores in self.rewards.finished(now)
        ]

    def active(self) -> bool:
        return bool(self.pending.running or self.scoring)

    def background(self) -> bool:
        return False

    def wait(self, timeout_s: float) -> None:
        time.sleep(timeout_s)

    def request_ids(self) -> list[str]:
        return self.pending.request_ids()

    def metrics(self) -> dict[str, float]:
        return {"actor/prompts_too_long": self.prompts_too_long, **self.rewards.metrics()}

    def progress(self) -> int:
        return 0

    def close(self) -> None:
        self.rewards.close()


class EpisodeRollouts:
    """`n` episodes per prompt on the episode driver (`actors.environments.episodes`), built into a group once all have ended."""

    def __init__(self, driver: EpisodeDriver, generator_id: int) -> None:
        self.driver, self.generator_id = driver, generator_id
        self._ended: list[RolloutGroup] = []

    def start(self, lease_id: int, prompt: PromptItem) -> bool:
        self.driver.start_group(lease_id, prompt)  # the episodes render their own first observations (reset)
        return True

    def on_sample(self, sample: FinishedSample) -> None:
        self.driver.on_turn(sample)

    def advance(self, submit: bool) -> None:
        for group in self.driver.advance(submit=submit):
            built = build_episode_group(
                group.lease_id, group.prompt, group.results, self.generator_id, group.started_at
            )
            self._ended.append(built)

    def finished(self, now: float) -> list[RolloutGroup]:
        ended, self._ended = self._ended, []
        return ended

    def active(self) -> bool:
        return self.driver.active() or bool(self._ended)

    def background(self) -> bool:
        return bool(self.driver.calling)

    def wait(self, timeout_s: float) -> None:
        self.driver.wait(timeout_s)  # wakes as soon as an environment call finishes

    def request_ids(self) -> list[str]:
        return self.driver.request_ids()

    def metrics(self) -> dict[str, float]:
        return self.driver.metrics()

    def progress(self) -> int:
        return self.driver.calls_answered

    def close(self) -> None:
        self.driver.close()


def rollouts_maker(config: TandemConfig, generator_id: int) -> Callable[[Engine], Rollouts]:
    """What builds this generator's rollouts once its engine is up. The reward sources or the environment are
    resolved now, before the engine's slow start, so a misnamed one (or arguments the environment's `prepare`
    refuses) stops the generator at once. A reward that fails on most samples stops it later
    (`actors.rewards.failure_guard`, env.stop_failure_share)."""
    group_size = config.algo.group_size
    if not config.env.environment:
        rewards = GroupRewards.from_config(config, f"generator-{generator_id}")
        max_model_len = config.model.max_model_len

        def single_turn(engine: Engine) -> Rollouts:
            return SingleTurnRollouts(engine, rewards, group_size, max_model_len, generator_id)

        return guarded(single_turn, config.env.stop_failure_share)
    from actors.environments.runner import EnvRunner
    from common.envs import environment_factory

    environments = environment_factory(config.env)
    limits = EpisodeLimits.from_config(config)
    workers = config.env.env_workers

    def episodes(engine: Engine) -> Rollouts:
        driver = EpisodeDriver(engine, environments, limits, EnvRunner(workers), group_size)
        return EpisodeRollouts(driver, generator_id)

    return guarded(episodes, config.env.stop_failure_share)
