"""A group's rewards: the reward function's components and the learned reward model's score, weighted and summed.

    rewards = GroupRewards.from_config(config, name="generator-0")
    rewards.submit(key, prompt, completions, now)        # the function scores now; the reward model now or later
    for key, scores in rewards.finished(now):            # list[Score] per group, in completion order
        ...build the group...

The scalar reward of a sample = env.reward_fn_weight * (the function's reward: the sum of its components)
                               + reward.weight * (the reward model's score: raw, or normalised by reward.normalize).
The components kept are the RAW ones: the function's own (`correct`, `format`, ...) and `reward_model` (the score
before reward.weight). A source of weight 0 is still scored and recorded, and adds nothing: a run trained on the
reward model alone shows the verifier's verdict beside it (reward/<name> in the learner's metrics).

Where the reward model runs: nowhere (env.reward_model empty); in this process (reward.in_process: the generator
loads actors.rewards.model itself, scoring is synchronous); or in the reward service (actors.rewards.client: the
group waits, the generator's loop goes on). Failures fall back per source, are counted and logged, and mark the
sample's finish reason `env_error: reward: ...`: a function that raises gives env.failure_reward as the function's
reward (no components), the reward model that cannot score (service down or slow, a scoring error) gives
env.failure_reward as the `reward_model` component (`model_fallbacks`, groups).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

from actors.rewards.client import RewardClient
from actors.rewards.functions import RewardScorer, Score
from common.config import TandemConfig
from common.reward_routing import has_reward_fn
from common.sockets import SocketSecurity

log = logging.getLogger("tandem.actors.group_rewards")
REWARD_MODEL = "reward_model"  # the component name of the learned reward model's score


def combine(
    n: int,
    function: list[Score] | None,
    model: list[float] | None,
    model_error: str,
    function_weight: float,
    model_weight: float,
    fallback: float,
) -> list[Score]:
    """The `n` samples' Scores from the two sources (module docstring). `function` None: no reward function;
    `model` None: no reward model when `model_error` is "", else it fell back (each sample gets `fallback`)."""
    if function is None and model is None and not model_error:
        raise ValueError("nothing scored the group: neither a reward function nor a reward model")
    if any(part is not None and len(part) != n for part in (function, model)):
        raise ValueError(f"a source scored {len(function or model or [])} of the group's {n} samples")
    scores = []
    for i in range(n):
        reward, components, errors = 0.0, {}, []
        if function is not None:
            reward += function_weight * function[i].reward
            components.update(function[i].components)
            if function[i].error is not None:
                errors.append(function[i].error)
        if model is not None or model_error:
            value = model[i] if model is not None else fallback
            reward += model_weight * value
            components[REWARD_MODEL] = value
            if model_error:
                errors.append(f"{REWARD_MODEL}: {model_error}")
        scores.append(Score(reward, components, "; ".join(errors)[:500] if errors else None))
    return scores


class GroupRewards:
    """Scores whole groups from every configured source (module docstring). One thread."""

    def __init__(
        self, config: TandemConfig, function: RewardScorer | None, model: Any, client: RewardClient | None
    ) -> None:
        # model: an actors.rewards.model.RewardModelScorer (in-process), or None
        self.env, self.reward = config.env, config.reward
        self.function = function
        self.model = model
        self.client = client
        self.ready: list[tuple[Hashable, list[Score]]] = []
        self.waiting: dict[Hashable, tuple[int, list[Score] | None]] = {}  # key -> (n, the function's scores)
        self.model_fallbacks = 0  # groups whose reward_model component fell back (in-process and service)

    @classmethod
    def from_config(cls, config: TandemConfig, name: str) -> GroupRewards:
        """The sources the config names; a misnamed reward function or an RM that cannot load raises now."""
        env = config.env
        function = RewardScorer(env) if has_reward_fn(env) else None
        model = client = None
        if env.reward_model and config.reward.in_process:
            from pathlib import Path

            from actors.rewards.model import RewardModelScorer
            from common.chat_format import chat_format

            reward = config.reward
            model = RewardModelScorer(  # on the CPU: vLLM holds the GPU's memory
                Path(env.reward_model),
                reward.dtype,
                reward.batch_size,
                config.model.max_model_len,
                reward.normalize,
                device="cpu",
                chat=chat_format(config.model),
            )
            log.info("reward model in this process: %s", model.describe())
        elif env.reward_model:
            security = SocketSecurity.from_run(config.run)
            client = RewardClient(config.reward.address, security, config.reward.timeout_s, name)
            log.info("reward model scored by the reward service at %s", config.reward.address)
        return cls(config, function, model, client)

    def submit(
        self, key: Hashable, prompt: list[dict[str, str]], completions: list[str], metadata: dict, now: float
    ) -> None:
        """Score a group: the function now, the reward model now (in-process) or once the service answers."""
        function = [self.function.score(text, metadata) for text in completions] if self.function else None
        if self.client is not None:
            self.waiting[key] = (len(completions), function)
            self.client.submit(key, prompt, completions, now)
            return
        model, error = None, ""
        if self.model is not None:
            model, error = self._score_here(key, prompt, completions)
        self.ready.append((key, self._combine(len(completions), function, model, error)))

    def _score_here(
        self, key: Hashable, prompt: list[dict[str, str]], completions: list[str]
    ) -> tuple[list[float] | None, str]:
        try:
            return self.model.score_group(prompt, completions), ""
        except Exception as error:  # noqa: BLE001 - a group the model cannot score falls back; the generator goes on
            self.model_fallbacks += 1
            why = f"{type(error).__name__}: {error}"[:300]
            log.warning("group %s: reward_model falls back (%d groups so far): %s", key, self.model_fallbacks, why)
            return None, why

    def finished(self, now: float) -> list[tuple[Hashable, list[Score]]]:
        """The groups scored since the last call (the service's answers and fallbacks collected now)."""
        done, self.ready = self.ready, []
        if self.client is not None and self.waiting:
            for result in self.client.collect(now):
                n, function = self.waiting.pop(result.key)
                if result.scores is None:
                    self.model_fallbacks += 1
                done.append((result.key, self._combine(n, function, result.scores, result.error)))
        return done

    def _combine(self, n: int, function: list[Score] | None, model: list[float] | None, error: str) -> list[Score]:
        env = self.env
        return combine(n, function, model, error, env.reward_fn_weight, self.reward.weight, env.failure_reward)

    def pending(self) -> int:
        """Groups submitted and not yet returned by `finished`."""
        return len(self.ready) + len(self.waiting)

    def metrics(self) -> dict[str, float]:
        values: dict[str, float] = {"actor/reward_errors": self.function.errors if self.function else 0}
        if self.function is not None:
            values["actor/reward_timeouts"] = self.function.timeouts
        if self.model is not None or self.client is not None:
            values["actor/reward_model_fallbacks"] = self.model_fallbacks
        if self.client is not None:
            values["actor/reward_model_late_replies"] = self.client.late_replies
            values["actor/reward_model_waiting"] = self.client.in_flight()
        return values

    def close(self) -> None:
        if self.function is not None:
            self.function.close()
        if self.client is not None:
            self.client.close()
