"""The token-exact record of a multi-turn episode, and the `RolloutGroup` built from a group of them.

    trajectory = Trajectory(first_observation_tokens)     # rendered reset() observation, generation prompt included
    engine.add(rid, trajectory.context(), max_tokens=...)  # a turn's prompt: the WHOLE token prefix so far
    trajectory.add_model_turn(sample)                      # exactly the sampled ids, their log-probs and versions
    trajectory.add_environment(engine.render_turn(sample.completion_tokens, observation))

Invariants (what the learner relies on):
  * `context()` = prompt + every appended token, in order: the next turn's prompt is exactly what the model saw,
    followed by what it sampled, followed by the environment's tokens. Nothing is re-tokenised.
  * completion arrays are aligned: model tokens have loss_mask 1, their behaviour log-prob and the policy version
    that sampled them; environment tokens have loss_mask 0, log-prob 0 and version -1 (`common.types`).

Group layout: a `RolloutGroup` has one prompt for its `n` samples. The episodes of a group may open with different
first observations (an environment may randomise them), so the group's prompt is the longest common token prefix
of the episodes' prompts and each episode's remainder opens its completion as environment tokens; the sequence
prompt + completion of every sample is unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from actors.engine.api import FinishedSample
from common.types import PromptItem, RolloutGroup

ENV_TOKEN_VERSION = -1  # token_versions of environment tokens (common.types)


class Trajectory:
    """Tokens of one episode after its first observation (see the module docstring). Appends only."""

    def __init__(self, prompt_tokens: list[int]) -> None:
        self.prompt = list(prompt_tokens)
        self._context = list(prompt_tokens)
        self._tokens: list[np.ndarray] = []  # segments, int32
        self._logprobs: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self._versions: list[np.ndarray] = []
        self.num_tokens = 0  # completion tokens: model + environment

    def context(self) -> list[int]:
        """Prompt + completion so far: the prompt of the next model turn."""
        return list(self._context)

    @property
    def context_length(self) -> int:
        return len(self._context)

    def add_model_turn(self, sample: FinishedSample) -> None:
        """Append a model turn exactly as sampled (ids, behaviour log-probs, per-token versions)."""
        tokens = np.asarray(sample.completion_tokens, dtype=np.int32)
        self._append(
            tokens,
            np.asarray(sample.behaviour_logprobs, dtype=np.float32),
            1,
            np.asarray(sample.token_versions, dtype=np.int32),
        )

    def add_environment(self, tokens: list[int]) -> None:
        """Append environment tokens (an observation as a chat-template delta): no loss, no log-prob."""
        array = np.asarray(tokens, dtype=np.int32)
        self._append(array, np.zeros(len(array), np.float32), 0, np.full(len(array), ENV_TOKEN_VERSION, np.int32))

    def _append(self, tokens: np.ndarray, logprobs: np.ndarray, mask: int, versions: np.ndarray) -> None:
        if not len(tokens) == len(logprobs) == len(versions):
            raise ValueError(
                f"misaligned turn: {len(tokens)} tokens, {len(logprobs)} log-probs, {len(versions)} versions"
            )
        self._tokens.append(tokens)
        self._logprobs.append(logprobs)
        self._mask.append(np.full(len(tokens), mask, np.uint8))
        self._versions.append(versions)
        self._context.extend(tokens.tolist())
        self.num_tokens += len(tokens)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(tokens int32 [T], behaviour_logprobs float32 [T], loss_mask uint8 [T], token_versions int32 [T])."""

        def joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

        return (
            joined(self._tokens, np.int32),
            joined(self._logprobs, np.float32),
            joined(self._mask, np.uint8),
            joined(self._versions, np.int32),
        )


@dataclass
class EpisodeResult:
    """A finished episode: its trajectory, reward and why it ended. An episode that ended before its first
    observation has the task's own rendered messages as its prompt and no completion tokens.

    reward = sum(components.values()); components are `turn_reward_sum` (steps before the last), `terminal` (the
    step that said done, less its named parts: its `info["components"]`, a verifiers rubric's say, each a component
    too) and `failure` (env.failure_reward when an error or timeout ended it; the others are then 0).
    """

    trajectory: Trajectory
    start_version: int  # policy version when the episode started (its version if it has no model token)
    finish_reason: str
    turns: int
    components: dict[str, float] = field(default_factory=dict)

    @property
    def reward(self) -> float:
        return float(sum(self.components.values()))


def _common_prefix_length(sequences: list[list[int]]) -> int:
    shortest = min(len(s) for s in sequences)
    for i in range(shortest):
        if any(s[i] != sequences[0][i] for s in sequences[1:]):
            return i
    return shortest


def build_episode_group(
    lease_id: int, prompt: PromptItem, results: list[EpisodeResult], generator_id: int, started_at: float
) -> RolloutGroup:
    """The columnar group of `n` finished episodes of one prompt (layout in the module docstring).

    versions[i] is the oldest version among sample i's model tokens (its start version if it has none).
    """
    prompts = [r.trajectory.prompt for r in results]
    shared = _common_prefix_length(prompts)
    columns: list[tuple[np.ndarray, ...]] = []
    versions = []
    for result, own_prompt in zip(results, prompts):
        head = Trajectory([])
        head.add_environment(own_prompt[shared:])
        body = result.trajectory.arrays()
        columns.append(tuple(np.concatenate([a, b]) for a, b in zip(head.arrays(), body)))
        model_versions = body[3][body[2] == 1]
        versions.append(int(model_versions.min()) if len(model_versions) else result.start_version)
    lengths = [len(c[0]) for c in columns]
    names = sorted({name for r in results for name in r.components})
    return RolloutGroup(
        lease_id=lease_id,
        prompt_id=prompt.prompt_id,
        epoch=prompt.epoch,
        generator_id=generator_id,
        prompt_tokens=np.asarray(prompts[0][:shared], dtype=np.int32),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        completion_tokens=np.concatenate([c[0] for c in columns]).astype(np.int32),
        behaviour_logprobs=np.concatenate([c[1] for c in columns]).astype(np.float32),
        loss_mask=np.concatenate([c[2] for c in columns]).astype(np.uint8),
        token_versions=np.concatenate([c[3] for c in columns]).astype(np.int32),
        versions=np.asarray(versions, dtype=np.int32),
        rewards=np.asarray([r.reward for r in results], dtype=np.float32),
        reward_components={
            name: np.asarray([r.components.get(name, 0.0) for r in results], dtype=np.float32) for name in names
        },
        finish_reasons=[r.finish_reason for r in results],
        started_at=started_at,
        finished_at=time.time(),
    )
