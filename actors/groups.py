"""Turning finished samples into the columnar `RolloutGroup` the buffer ingests, and the prompt lifecycle around it.

A prompt goes: leased (`LeaseBook.add_grant`) -> queued -> rolled out (`actors.rollouts`; single-turn: in the
engine as `n` requests, `PendingGroups.start`, each finished sample recorded, `record`, and once all `n` are back
the `PendingGroup` is scored and built, `build_group`) -> pushed -> `LeaseBook.close_prompt`.
`LeaseBook.in_flight()` counts prompts leased and not yet built into a group: the generator leases more whenever
it is below `prompts_in_flight`.

Request ids are `"<lease_id>:<prompt_id>:<sample index>"`: unique while a lease lives, and they say which group a
sample belongs to without a lookup table in the engine.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from actors.engine.api import FinishedSample
from actors.rewards.functions import Score
from common.types import LeaseGrant, PromptItem, RolloutGroup


def sample_request_id(lease_id: int, prompt_id: int, index: int) -> str:
    return f"{lease_id}:{prompt_id}:{index}"


def parse_request_id(request_id: str) -> tuple[int, int, int]:
    """(lease_id, prompt_id, sample index) of a request id made by `sample_request_id`."""
    lease_id, prompt_id, index = request_id.split(":")
    return int(lease_id), int(prompt_id), int(index)


@dataclass
class PendingGroup:
    """The `n` samples of one prompt while they are generated; `samples[i]` is None until sample i finishes."""

    lease_id: int
    prompt: PromptItem
    prompt_tokens: list[int]
    started_at: float  # unix time the requests were added to the engine
    samples: list[FinishedSample | None]

    @property
    def complete(self) -> bool:
        return all(s is not None for s in self.samples)

    @property
    def request_ids(self) -> list[str]:
        return [sample_request_id(self.lease_id, self.prompt.prompt_id, i) for i in range(len(self.samples))]


def build_group(pending: PendingGroup, scores: list[Score], generator_id: int) -> RolloutGroup:
    """The columnar group of a complete `PendingGroup` (alignment rules: `common.types`).

    Single-turn: every completion token is a model action (loss_mask 1). `versions[i]` is the version sample i
    started with, which is the oldest among its tokens (versions only rise). A sample whose reward failed keeps
    its tokens, gets env.failure_reward in `scores`, and its finish reason becomes `"env_error: reward: ..."`.
    Component names are the union over the group; a sample without a component has 0 for it.
    """
    samples = [s for s in pending.samples if s is not None]
    if len(samples) != len(pending.samples) or len(scores) != len(samples):
        raise ValueError(f"group {pending.lease_id}:{pending.prompt.prompt_id} is incomplete or unscored")
    lengths = [len(s.completion_tokens) for s in samples]
    names = sorted({name for score in scores for name in score.components})
    return RolloutGroup(
        lease_id=pending.lease_id,
        prompt_id=pending.prompt.prompt_id,
        epoch=pending.prompt.epoch,
        generator_id=generator_id,
        prompt_tokens=np.asarray(pending.prompt_tokens, dtype=np.int32),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        completion_tokens=np.concatenate([s.completion_tokens for s in samples]).astype(np.int32),
        behaviour_logprobs=np.concatenate([s.behaviour_logprobs for s in samples]).astype(np.float32),
        loss_mask=np.ones(sum(lengths), dtype=np.uint8),
        token_versions=np.concatenate([s.token_versions for s in samples]).astype(np.int32),
        versions=np.asarray([s.start_version for s in samples], dtype=np.int32),
        rewards=np.asarray([score.reward for score in scores], dtype=np.float32),
        reward_components={
            name: np.asarray([score.components.get(name, 0.0) for score in scores], dtype=np.float32) for name in names
        },
        finish_reasons=[
            s.finish_reason if score.error is None else f"env_error: reward: {score.error}"
            for s, score in zip(samples, scores)
        ],
        started_at=pending.started_at,
        finished_at=time.time(),
    )


class LeaseBook:
    """The prompts this generator holds, from lease to built group (see the module docstring). One thread."""

    def __init__(self) -> None:
        self.leases: dict[int, dict[int, PromptItem]] = {}  # lease_id -> prompt_id -> prompt, until built
        self.queued: deque[tuple[int, PromptItem]] = deque()

    def add_grant(self, grant: LeaseGrant) -> None:
        lease = self.leases.setdefault(grant.lease_id, {})
        for prompt in grant.prompts:
            lease[prompt.prompt_id] = prompt
            self.queued.append((grant.lease_id, prompt))

    def in_flight(self) -> int:
        """Prompts leased and not yet built into a group (queued + being rolled out)."""
        return sum(len(lease) for lease in self.leases.values())

    def lease_ids(self) -> list[int]:
        return sorted(self.leases)

    def take_queued(self) -> tuple[int, PromptItem] | None:
        return self.queued.popleft() if self.queued else None

    def close_prompt(self, lease_id: int, prompt_id: int) -> None:
        """The prompt's group is built (or the prompt is given up): it no longer counts as in flight."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return
        lease.pop(prompt_id, None)
        if not lease:
            del self.leases[lease_id]

    def unfinished(self) -> dict[int, list[int]]:
        """lease_id -> prompt ids not yet built into a group (what `LeaseReturn` gives back on shutdown)."""
        return {lease_id: sorted(lease) for lease_id, lease in self.leases.items() if lease}


class PendingGroups:
    """Single-turn groups while their `n` samples generate: `start` when the requests are added, `record` each
    finished sample. One thread."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.running: dict[tuple[int, int], PendingGroup] = {}

    def start(self, lease_id: int, prompt: PromptItem, prompt_tokens: list[int]) -> PendingGroup:
        """Register a prompt whose `n` requests are being added to the engine."""
        pending = PendingGroup(lease_id, prompt, prompt_tokens, time.time(), [None] * self.group_size)
        self.running[(lease_id, prompt.prompt_id)] = pending
        return pending

    def record(self, sample: FinishedSample) -> PendingGroup | None:
        """Store a finished sample; returns its group once all `n` samples are back (and stops tracking it).
        A sample of a group no longer tracked (dropped) is ignored."""
        lease_id, prompt_id, index = parse_request_id(sample.request_id)
        pending = self.running.get((lease_id, prompt_id))
        if pending is None:
            return None
        pending.samples[index] = sample
        if not pending.complete:
            return None
        del self.running[(lease_id, prompt_id)]
        return pending

    def request_ids(self) -> list[str]:
        return [rid for pending in self.running.values() for rid in pending.request_ids]
