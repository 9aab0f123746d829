"""The semantic layer under fuzz: well-formed messages (each one decodes) with hostile values, against `BufferCore`
directly (no sockets), as generators, learner ranks and strangers would send them, interleaved with clock jumps.

After every message: nothing but `RequestRejected` came out of the core; the ledger balances (arrived = trained +
dropped_stale + evicted + rejected + buffered, in samples and in groups); and every group served in a batch obeys
the content rules, checked here independently of `buffers.checks`: ids within the vocabulary, a non-empty prompt
with prompt + completion <= max_model_len, rewards and components finite and within max_abs_reward, behaviour
log-probs finite and <= 0, versions >= 0 and staleness within η.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from buffers.core import BufferCore, RequestRejected
from common.types import (
    MAX_COUNT,
    MAX_VERSION,
    Batch,
    BatchRequest,
    Heartbeat,
    LeaseGrant,
    LeaseRequest,
    LeaseReturn,
    PromptItem,
    RolloutGroup,
    StatsRequest,
    VersionReport,
)
from common.wire import WireError, decode, encode
from tests.buffers.fakes import GROUP, MAX_ABS_REWARD, MAX_MODEL_LEN, VOCAB, make_core, make_group

ETA = 1
counts = st.one_of(st.integers(0, 8), st.sampled_from([2**31 - 1, 2**32, MAX_COUNT]))
versions = st.one_of(st.integers(0, 4), st.sampled_from([MAX_VERSION - 1, MAX_VERSION]))
int32s = st.one_of(st.integers(-3, VOCAB + 3), st.sampled_from([-(2**31), 2**31 - 1, VOCAB - 1, VOCAB]))
float32s = st.one_of(
    st.floats(-2.0, 2.0, width=32),
    st.sampled_from([0.0, -0.0, 3e38, -3e38, 1e6, 1.0000001e6, -1e-45, float("nan"), float("inf"), float("-inf")]),
)


@st.composite
def hostile_group(
    draw: st.DrawFn, lease_id: int, prompt: tuple[int, int], generator_id: int, version: int
) -> RolloutGroup:
    """A group for this lease and prompt, from a valid one with a few hostile edits (it may still be valid)."""
    size = draw(st.sampled_from([GROUP] * 6 + [1, GROUP + 1]))
    tokens = draw(st.sampled_from([1, 8, 8, MAX_MODEL_LEN - 5, MAX_MODEL_LEN]))  # 5 prompt tokens: the last too long
    version = draw(st.one_of(st.just(version), st.just(version), versions))
    group = make_group(lease_id, prompt, generator_id, size, version, tokens, seed=draw(st.integers(0, 9)))
    edits: dict[str, Any] = {}
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
        name = draw(st.sampled_from(["prompt", "tokens", "rewards", "logprobs", "components", "versions", "lengths"]))
        if name == "prompt":
            edits["prompt_tokens"] = np.array(draw(st.lists(int32s, max_size=MAX_MODEL_LEN + 1)), np.int32)
        elif name == "tokens":
            edits["completion_tokens"] = _poke(draw, group.completion_tokens, int32s, np.int32)
        elif name == "rewards":
            edits["rewards"] = _poke(draw, group.rewards, float32s, np.float32)
        elif name == "logprobs":
            edits["behaviour_logprobs"] = _poke(draw, group.behaviour_logprobs, float32s, np.float32)
        elif name == "components":
            values = draw(st.lists(float32s, min_size=size, max_size=size))
            edits["reward_components"] = {draw(st.sampled_from(["format", "x" * 200])): np.array(values, np.float32)}
        elif name == "versions":
            edits["versions"] = _poke(draw, group.versions, st.integers(-2, 2**31 - 1), np.int32)
            edits["token_versions"] = _poke(draw, group.token_versions, st.integers(-2, 2**31 - 1), np.int32)
        else:  # one sample emptied, its tokens moved to the next: offsets stay aligned
            offsets = group.offsets.copy()
            if size > 1:
                offsets[1] = 0
            edits["offsets"] = offsets
    return dataclasses.replace(group, **edits)


def _poke(draw: st.DrawFn, values: np.ndarray, items: st.SearchStrategy, dtype: type) -> np.ndarray:
    """A copy of `values` with a few entries replaced by drawn ones."""
    out = values.copy()
    for _ in range(draw(st.integers(1, 3))):
        if len(out):
            out[draw(st.integers(0, len(out) - 1))] = dtype(draw(items))
    return out


def assert_trainable(group: RolloutGroup, staleness: np.ndarray, step: int) -> None:
    """The content rules, checked without `buffers.checks`."""
    prompt, lengths = group.prompt_tokens, np.diff(group.offsets)
    assert group.size == GROUP and len(prompt) >= 1 and group.num_tokens >= 1
    assert all(len(prompt) + int(n) <= MAX_MODEL_LEN for n in lengths)
    for ids in (prompt, group.completion_tokens):
        assert all(0 <= int(i) < VOCAB for i in ids), ids
    for values in (group.rewards, *group.reward_components.values()):
        assert all(np.isfinite(v) and abs(float(v)) <= MAX_ABS_REWARD for v in values), values
    assert all(np.isfinite(v) and v <= 0 for v in group.behaviour_logprobs)
    assert all(0 <= int(v) for v in group.versions)
    assert staleness.tolist() == [step - int(v) for v in group.versions] and max(staleness) <= ETA


class Fuzzer:
    """Three generators, a learner of two ranks and a stranger, driven by hypothesis draws."""

    def __init__(self, core: BufferCore) -> None:
        self.core = core
        self.now = 0.0
        self.leased: list[tuple[int, PromptItem, int]] = []  # (lease, prompt, generator) not yet pushed
        self.served = 0
        self.trained: list[int] = []  # steps served and not reported yet

    def step(self, draw: st.DrawFn) -> None:
        kinds = ["lease", "lease", "group", "group", "group", "batch", "batch", "other", "time"]
        self.send(draw, self._message(draw, draw(st.sampled_from(kinds))))

    def send(self, draw: st.DrawFn, message: Any) -> None:
        if message is None:
            return
        try:
            message, _ = decode(encode(message))  # well-formed only: what passes the wire, read-only arrays
        except WireError:
            event("not well-formed: skipped")
            return
        try:
            replies = self.core.handle(message, reply_to=draw(st.integers(0, 3)), sender="fuzz", now=self.now)
        except RequestRejected as refusal:
            event(f"refused: {refusal.kind}")
            return
        self._check(replies)

    def _message(self, draw: st.DrawFn, kind: str) -> Any:
        version = self.core.state.learner_version
        if kind == "lease":
            return LeaseRequest(draw(st.integers(0, 2)), draw(counts), draw(st.one_of(st.just(version), versions)))
        if kind == "group":
            if self.leased and draw(st.sampled_from([True, True, True, False])):
                lease_id, prompt, generator = self.leased.pop(draw(st.integers(0, len(self.leased) - 1)))
                generator = draw(st.sampled_from([generator] * 4 + [7]))
                return draw(hostile_group(lease_id, (prompt.prompt_id, prompt.epoch), generator, version))
            return draw(hostile_group(draw(counts), (draw(counts), draw(counts)), draw(counts), version))
        if kind == "batch":
            if draw(st.booleans()):  # the learner (one rank), asking for its next step
                return BatchRequest(version, 0, 1, 2, 0.0)
            step = draw(st.one_of(st.just(version), versions))
            world_size = draw(st.sampled_from([1, 2, 2, 3, 0]))
            rank, groups = draw(st.integers(0, 3)), draw(st.sampled_from([2, 2, 4, 1, 0, MAX_COUNT]))
            return BatchRequest(step, rank, world_size, groups, draw(st.sampled_from([0.0, 0.0, 5.0, 600.0, 601.0])))
        if kind == "other":
            return draw(
                st.sampled_from(
                    [
                        VersionReport(version + 1, version + 1),
                        VersionReport(draw(versions), draw(versions)),
                        Heartbeat(draw(st.integers(0, 2)), draw(versions), draw(st.lists(counts, max_size=4))),
                        LeaseReturn(draw(st.integers(0, 3)), draw(counts), draw(st.lists(counts, max_size=3))),
                        StatsRequest(),
                    ]
                )
            )
        self.now += draw(st.sampled_from([0.5, 3.0, 20.0]))  # leases last 10 s, generators go silent after 3 s
        self._check(self.core.tick(self.now))
        return None

    def _check(self, replies: list[tuple[Any, Any]]) -> None:
        state = self.core.state
        assert state.ledger.gap(state.replay.samples, len(state.replay)) == (0, 0), self.core.counters()
        for _, reply in replies:
            if isinstance(reply, LeaseGrant):
                generator = state.dispenser.leases[reply.lease_id].generator_id
                self.leased += [(reply.lease_id, prompt, generator) for prompt in reply.prompts]
            if isinstance(reply, Batch):
                for group, lag in zip(reply.groups, reply.staleness):
                    assert_trainable(group, lag, reply.step)
                    self.served += 1
                self.trained.append(reply.step)

    def report(self, draw: st.DrawFn) -> None:
        """The learner reports each step it got a batch for (the trained step + 1), as a learner does."""
        while self.trained:
            step = self.trained.pop(0) + 1
            self.send(draw, VersionReport(step, step))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), reuse=st.integers(1, 2), sampling=st.sampled_from(["fifo", "uniform"]))
def test_hostile_values_never_crash_the_core_unbalance_its_books_or_get_served(data, reuse, sampling) -> None:
    core = make_core(prompts=12, max_staleness=ETA, max_reuse=reuse, sampling=sampling, capacity=6 * GROUP)
    fuzzer = Fuzzer(core)
    for _ in range(data.draw(st.integers(20, 120), label="messages")):
        fuzzer.step(data.draw)
        fuzzer.report(data.draw)
    event(f"groups served: {min(fuzzer.served, 5)}+" if fuzzer.served >= 5 else f"groups served: {fuzzer.served}")
    rejected = {k for k, v in core.counters().items() if k.startswith("rejected_") and v and k != "rejected_groups"}
    for kind in sorted(rejected):
        event(f"rejected group kind seen: {kind}")
