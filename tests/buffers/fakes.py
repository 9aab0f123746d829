"""Fakes for the buffer's tests: synthetic prompts and rollout groups (no model, no vLLM)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from buffers.core import BufferCore
from buffers.journal import Journal
from buffers.state import BufferSettings, BufferState
from common.types import (
    Batch,
    BatchRequest,
    LeaseGrant,
    LeaseRequest,
    LeaseReturn,
    PromptItem,
    RolloutGroup,
    VersionReport,
)


@dataclass
class FakePrompt:
    """Stands in for common.tasks.PromptRecord (the dispenser needs only these three fields)."""

    prompt_id: int
    messages: list[dict[str, str]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)


def fake_prompts(count: int) -> list[FakePrompt]:
    return [FakePrompt(i, [{"role": "user", "content": f"{i} + 1 = ?"}], {"answer": i + 1}) for i in range(count)]


def without_deadlines(snapshot: dict[str, Any]) -> dict[str, Any]:
    """A dispenser snapshot less its leases' deadlines: a restart renews them (`PromptDispenser.restart`)."""
    return {**snapshot, "leases": [[*record[:3], None, *record[4:]] for record in snapshot["leases"]]}


def make_group(
    lease_id: int,
    prompt: PromptItem | tuple[int, int],
    generator_id: int = 0,
    size: int = 4,
    version: int | list[int] = 0,
    tokens: int = 8,
    seed: int = 0,
) -> RolloutGroup:
    """A valid group of `size` samples of `tokens` tokens each, every token produced by `version`
    (or versions[i] for sample i)."""
    prompt_id, epoch = (prompt.prompt_id, prompt.epoch) if isinstance(prompt, PromptItem) else prompt
    versions = np.broadcast_to(np.asarray(version, np.int32), (size,)).copy()
    total = size * tokens
    rng = np.random.default_rng(seed)
    return RolloutGroup(
        lease_id=lease_id,
        prompt_id=prompt_id,
        epoch=epoch,
        generator_id=generator_id,
        prompt_tokens=np.arange(5, dtype=np.int32),
        offsets=np.arange(0, total + 1, tokens, dtype=np.int64),
        completion_tokens=rng.integers(0, 1000, total).astype(np.int32),
        behaviour_logprobs=-rng.random(total).astype(np.float32),
        loss_mask=np.ones(total, np.uint8),
        token_versions=np.repeat(versions, tokens).astype(np.int32),
        versions=versions,
        rewards=rng.random(size).astype(np.float32),
        finish_reasons=["stop"] * size,
    )


# What hostile content breaks (`buffers.checks.group_problem`), one way each: kind -> changes to a valid group.
HOSTILE = {
    "bad_token": lambda g: {
        "completion_tokens": np.where(np.arange(g.num_tokens) == 0, VOCAB + 7, g.completion_tokens)
    },
    "negative_token": lambda g: {"prompt_tokens": np.array([3, -1, 4], np.int32)},
    "empty_prompt": lambda g: {"prompt_tokens": np.zeros(0, np.int32)},
    "too_long": lambda g: {"prompt_tokens": np.zeros(MAX_MODEL_LEN, np.int32)},
    "huge_reward": lambda g: {"rewards": np.where(np.arange(g.size) < 2, np.float32(3e38), 0).astype(np.float32)},
    "nan_component": lambda g: {"reward_components": {"format": np.full(g.size, np.nan, np.float32)}},
    "inf_component": lambda g: {"reward_components": {"format": np.full(g.size, -np.inf, np.float32)}},
    "positive_logprob": lambda g: {"behaviour_logprobs": np.abs(g.behaviour_logprobs) + np.float32(0.5)},
    "future_token_version": lambda g: {"token_versions": np.full(g.num_tokens, 10**6, np.int32)},
}


def hostile_group(lease_id: int, prompt: PromptItem | tuple[int, int], how: str, generator_id: int = 0, **kw: Any):
    """A group that decodes (it passes `validate`) but that the buffer must never serve: `HOSTILE[how]` applied."""
    group = make_group(lease_id, prompt, generator_id, **kw)
    return dataclasses.replace(group, **HOSTILE[how](group))


# ------------------------------------------------------------------------------------------------ driving a core
GROUP = 4
VOCAB, MAX_MODEL_LEN, MAX_ABS_REWARD = 1000, 64, 1e6  # make_group: ids < 1000, 5 prompt + 8 completion tokens
OP_MIX = ["lease"] * 2 + ["push"] * 3 + ["learn"] * 2 + ["sync"] * 2 + ["resend", "bad", "time", "return"]


def random_ops(min_size: int = 20, max_size: int = 120) -> Any:
    """The hypothesis strategy of a `RandomRun`'s operations: (kind from OP_MIX, a seed for its choices) pairs."""
    from hypothesis import strategies as st

    return st.lists(st.tuples(st.sampled_from(OP_MIX), st.integers(0, 1 << 16)), min_size=min_size, max_size=max_size)


def make_settings(**overrides: Any) -> BufferSettings:
    values = {
        "capacity": 400,
        "max_reuse": 1,
        "sampling": "fifo",
        "lease_timeout_s": 10.0,
        "heartbeat_timeout_s": 3.0,
        "epochs": 0,
        "group_size": GROUP,
        "max_staleness": 1,
        "groups_per_step": 2,
        "sync_every": 1,
        "seed": 0,
        "vocab_size": VOCAB,
        "max_model_len": MAX_MODEL_LEN,
        "max_abs_reward": MAX_ABS_REWARD,
    }
    values.update(overrides)
    return BufferSettings(**values)


def make_core(prompts: int = 40, journal: Journal | None = None, **overrides: Any) -> BufferCore:
    return BufferCore(BufferState(make_settings(**overrides), fake_prompts(prompts), journal=journal))


def advance_learner(core: BufferCore, version: int) -> None:
    """Move the learner to step and version `version` as if it had trained that far on batches drawn elsewhere:
    the state event itself, without a VersionReport, whose order checks (no step past the draws, see
    `buffers.authority`) are not what the tests that call this are about."""
    core.state.report_version(version, version)


def ask(core: BufferCore, message: Any, now: float = 0.0) -> Any:
    """The single reply to `message` (asserts there is exactly one)."""
    replies = core.handle(message, reply_to="me", sender="test", now=now)
    assert len(replies) == 1 and replies[0][0] == "me", replies
    return replies[0][1]


class RandomRun:
    """Plays random operations against a core as three generators and a learner with `world_size` ranks would:
    leases, pushes in any order (at the version the generator held), resends, malformed groups, learner steps
    (checking every served sample's staleness), weight syncs, clock jumps (lease expiries) and returns."""

    def __init__(self, core: BufferCore, world_size: int = 1) -> None:
        self.core, self.world_size = core, world_size
        self.versions = [0, 0, 0]
        self.unsent: list[tuple[int, PromptItem, int, int]] = []  # (lease, prompt, generator, version)
        self.sent: list[tuple[int, PromptItem, int, int]] = []
        self.now = 0.0
        self.served: list[tuple[int, int]] = []  # group ids in the order the learner got them

    def play(self, op: str, pick: int) -> None:
        core, gen = self.core, pick % 3
        if op == "lease":
            reply = ask(core, LeaseRequest(gen, 1 + pick % 4, self.versions[gen]), self.now)
            if isinstance(reply, LeaseGrant):
                self.unsent += [(reply.lease_id, p, gen, self.versions[gen]) for p in reply.prompts]
        elif op in ("push", "bad") and self.unsent:
            lease_id, prompt, g, version = self.unsent.pop(pick % len(self.unsent))
            ask(core, make_group(lease_id, prompt, g, GROUP + (op == "bad"), version), self.now)
            self.sent.append((lease_id, prompt, g, version))
        elif op == "resend" and self.sent:
            lease_id, prompt, g, version = self.sent[pick % len(self.sent)]
            ask(core, make_group(lease_id, prompt, g, GROUP, version), self.now)  # duplicate, or late but first
        elif op == "learn":
            self.learn()
        elif op == "sync":
            self.versions[gen] = core.state.learner_version
        elif op == "time":
            self.now += 3 + pick % 8  # leases last 10 s: some expire
            core.tick(self.now)
        elif op == "return" and self.unsent:
            lease_id, prompt, g, _ = self.unsent.pop(pick % len(self.unsent))
            if lease_id in core.state.dispenser.leases:
                ask(core, LeaseReturn(g, lease_id, [prompt.prompt_id]), self.now)

    def learn(self) -> bool:
        """One learner step: every rank asks for its share; on success the learner reports step + 1."""
        core, step = self.core, self.core.state.learner_version
        eta = core.settings.max_staleness
        got = 0
        for rank in range(self.world_size):
            batch = ask(core, BatchRequest(step, rank, self.world_size, 2, 0.0), self.now)
            if isinstance(batch, Batch):
                got += 1
                for group, lag in zip(batch.groups, batch.staleness):
                    assert lag.tolist() == (step - group.versions).tolist()
                    assert lag.max() <= eta, f"served a sample {lag.max()} versions old at step {step} (η = {eta})"
                    self.served.append(group.group_id)
        assert got in (0, self.world_size)
        if got:
            ask(core, VersionReport(step + 1, step + 1), self.now)
        return bool(got)


def restarts(make: Callable[[], BufferCore], now: float) -> Iterator[BufferCore]:
    """A core `make` builds on the journal a run wrote, restored at `now`; then, after that core compacted the
    journal, another one restored from the compacted journal. Each is yielded restored, closed after."""
    for compact in (False, True):
        restarted = make()
        restarted.state.restore(now)
        yield restarted
        if not compact:
            restarted.state.compact(now)
        restarted.state.journal.close()
