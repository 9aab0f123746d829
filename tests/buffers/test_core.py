"""The buffer's answers to each message (no sockets): leases and admission, group acks, batches by rank,
held requests, rejections; and properties over random runs: the ledger balances after every message and
no served sample is ever staler than η."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from buffers.core import BufferCore, RequestRejected
from common.types import (
    Batch,
    BatchNotReady,
    BatchRequest,
    BufferStats,
    GroupAck,
    Heartbeat,
    LeaseGrant,
    LeaseRefused,
    LeaseRequest,
    LeaseReturn,
    Ok,
    StatsRequest,
    VersionReport,
)
from common.weight_messages import WeightsRequest
from tests.buffers.fakes import GROUP, RandomRun, advance_learner, ask, make_core, make_group, random_ops


def lease(core: BufferCore, count: int, version: int = 0, generator: int = 0, now: float = 0.0) -> LeaseGrant:
    grant = ask(core, LeaseRequest(generator, count, version), now)
    assert isinstance(grant, LeaseGrant), grant
    return grant


def push_all(core: BufferCore, grant: LeaseGrant, version: int = 0, generator: int = 0) -> list[GroupAck]:
    return [ask(core, make_group(grant.lease_id, p, generator, GROUP, version)) for p in grant.prompts]


def test_lease_grant_respects_admission_and_refuses_full_then_stale() -> None:
    core = make_core()  # B = 2, η = 1: (0 + 1 + 1) * 2 = 4 groups at v0
    assert len(lease(core, 3).prompts) == 3
    assert len(lease(core, 3, generator=1).prompts) == 1
    refused = ask(core, LeaseRequest(0, 3, 0))
    assert isinstance(refused, LeaseRefused) and refused.reason == "full" and refused.retry_after_s > 0
    for version in (1, 2):
        advance_learner(core, version)
    refused = ask(core, LeaseRequest(0, 3, 0))
    assert (refused.reason, refused.min_version) == ("stale", 1)
    assert len(lease(core, 8, version=2).prompts) == 4  # (2 + 1 + 1) * 2 - 4 outstanding
    assert core.counters()["admitted"] == 8


def test_group_acks_accepted_duplicate_and_rejected_with_reasons() -> None:
    core = make_core()
    grant = lease(core, 2, generator=3)
    first, second = grant.prompts
    assert ask(core, make_group(grant.lease_id, first, 3, GROUP)).status == "accepted"
    assert ask(core, make_group(grant.lease_id, first, 3, GROUP)).status == "duplicate"
    cases = {
        "unknown_lease": make_group(999, second, 3, GROUP),
        "wrong_generator": make_group(grant.lease_id, second, 4, GROUP),
        "wrong_group_size": make_group(grant.lease_id, second, 3, GROUP + 1),
        "future_version": make_group(grant.lease_id, second, 3, GROUP, version=5),
        "prompt_not_in_lease": make_group(grant.lease_id, (12345, 0), 3, GROUP),
    }
    for kind, group in cases.items():
        ack = ask(core, group)
        assert ack.status == "rejected" and ack.reason, kind
        assert core.counters()[f"rejected_{kind}"] == 1
    good = make_group(grant.lease_id, second, 3, GROUP)
    lying = dataclasses.replace(
        good, token_versions=np.zeros_like(good.token_versions), versions=np.full(GROUP, 1, np.int32)
    )
    advance_learner(core, 1)
    assert "oldest" in ask(core, lying).reason
    counters = core.counters()
    assert counters["rejected_groups"] == 6 and counters["rejected"] == 5 * GROUP + GROUP + 1
    assert counters["duplicates"] == 1 and counters["arrived_groups"] == 7
    # a group rejected for its content sends the prompt back for re-issue
    assert counters["prompts_reissued"] >= 1 and core.state.dispenser.queued == 1


def test_batches_split_by_rank_idempotent_and_forgotten_after_every_rank() -> None:
    core = make_core(groups_per_step=4, max_staleness=3)
    push_all(core, lease(core, 4))
    shares = [ask(core, BatchRequest(0, rank, 2, 4, 0.0)) for rank in (0, 1)]
    assert all(isinstance(s, Batch) and len(s.groups) == 2 for s in shares)
    ids = [g.group_id for s in shares for g in s.groups]
    assert len(set(ids)) == 4
    again = ask(core, BatchRequest(0, 1, 2, 4, 0.0))  # rank 1 lost its reply: the same share again
    assert [g.group_id for g in again.groups] == [g.group_id for g in shares[1].groups]
    assert 0 not in core.state.book.drawn  # every rank got it: forgotten (kept only as the last completed)
    counters = core.counters()
    assert counters["served_groups"] == 4 and counters["trained_groups"] == 4 and counters["buffered"] == 0
    assert all(lag.tolist() == [0] * GROUP for s in shares for lag in s.staleness)


def test_rank_retry_before_all_ranks_and_mismatch_rejected() -> None:
    core = make_core(groups_per_step=4, max_staleness=3)
    push_all(core, lease(core, 4))
    share = ask(core, BatchRequest(0, 0, 2, 4, 0.0))
    assert [g.group_id for g in ask(core, BatchRequest(0, 0, 2, 4, 0.0)).groups] == [g.group_id for g in share.groups]
    with pytest.raises(RequestRejected) as error:
        core.handle(BatchRequest(0, 1, 4, 4, 0.0), "me", "test", 0.0)
    assert error.value.kind == "batch_mismatch"


@pytest.mark.parametrize(
    "request_, kind",
    [
        (BatchRequest(0, 2, 2, 4, 1.0), "bad_rank"),
        (BatchRequest(0, -1, 2, 4, 1.0), "bad_rank"),
        (BatchRequest(0, 0, 2, 3, 1.0), "bad_num_groups"),
        (BatchRequest(0, 0, 1, 1000, 1.0), "bad_num_groups"),
        (BatchRequest(0, 0, 1, 2, -1.0), "bad_timeout"),
        (BatchRequest(0, 0, 1, 2, float("nan")), "bad_timeout"),
        (BatchRequest(5, 0, 1, 2, 1.0), "bad_step"),
        (VersionReport(3, 2), "bad_version"),
        (LeaseRequest(0, 0, 0), "bad_lease_request"),
        (LeaseRequest(0, 4, 7), "future_version"),
        (Heartbeat(-1, 0, []), "bad_generator"),
        (LeaseReturn(0, 77, [1]), "unknown_lease"),
        (WeightsRequest(0, -1), "unexpected_message"),
    ],
)
def test_bad_requests_are_rejected_with_a_kind_and_a_reason(request_, kind: str) -> None:
    core = make_core()
    with pytest.raises(RequestRejected) as error:
        core.handle(request_, "me", "test", 0.0)
    assert error.value.kind == kind and len(error.value.reason) > 10


def test_held_batch_request_is_served_when_groups_arrive_or_times_out() -> None:
    core = make_core()
    assert core.handle(BatchRequest(0, 0, 1, 2, 5.0), "learner", "test", now=0.0) == []
    grant = lease(core, 2)
    ack = core.handle(make_group(grant.lease_id, grant.prompts[0], 0, GROUP), "gen", "test", 1.0)
    assert [r for r, _ in ack] == ["gen"]
    replies = core.handle(make_group(grant.lease_id, grant.prompts[1], 0, GROUP), "gen", "test", 1.0)
    assert [r for r, _ in replies] == ["gen", "learner"] and isinstance(replies[1][1], Batch)
    assert core.handle(BatchRequest(1, 0, 1, 2, 5.0), "learner", "test", now=2.0) == []
    assert core.tick(6.9) == []
    timed_out = core.tick(7.0)
    assert timed_out == [("learner", BatchNotReady(1, 0))]
    assert isinstance(ask(core, BatchRequest(1, 0, 1, 2, 0.0)), BatchNotReady)


def test_every_held_rank_is_served_once_the_batch_can_be_drawn() -> None:
    core = make_core(groups_per_step=2)
    assert core.handle(BatchRequest(0, 1, 2, 2, 5.0), "rank1", "test", now=0.0) == []
    grant = lease(core, 2)
    assert len(core.handle(make_group(grant.lease_id, grant.prompts[0], 0, GROUP), "gen", "test", 0.5)) == 1
    assert core.handle(BatchRequest(0, 0, 2, 2, 5.0), "rank0", "test", now=1.0) == []
    replies = core.handle(make_group(grant.lease_id, grant.prompts[1], 0, GROUP), "gen", "test", 1.5)
    assert [(to, type(m).__name__, getattr(m, "rank", None)) for to, m in replies] == [
        ("gen", "GroupAck", None),
        ("rank0", "Batch", 0),
        ("rank1", "Batch", 1),
    ]
    assert core.state.book.held == {} and core.state.book.completed.step == 0


def test_stale_groups_are_dropped_at_draw_time_and_counted() -> None:
    core = make_core(max_staleness=1)
    old = lease(core, 2)
    push_all(core, old)
    for step in (1, 2):
        advance_learner(core, step)
    fresh = lease(core, 2, version=2)
    push_all(core, fresh, version=2)
    batch = ask(core, BatchRequest(2, 0, 1, 2, 0.0))
    assert {g.lease_id for g in batch.groups} == {fresh.lease_id}
    assert batch.dropped_stale == 2 * GROUP and core.counters()["dropped_stale_groups"] == 2


def test_expired_lease_prompts_are_reissued_after_heartbeat_timeout() -> None:
    core = make_core()
    dead = lease(core, 2, generator=0, now=0.0)
    ask(core, Heartbeat(1, 0, []), now=0.0)
    ask(core, Heartbeat(1, 0, []), now=2.9)
    core.tick(3.1)
    assert core.counters()["leases_expired"] == 1 and core.counters()["prompts_reissued"] == 2
    alive = lease(core, 2, generator=1, now=3.2)
    assert [p.prompt_id for p in alive.prompts] == [p.prompt_id for p in dead.prompts]
    assert core.counters()["generators_lost"] == 1


def test_lease_return_and_stats() -> None:
    core = make_core()
    grant = lease(core, 3)
    assert isinstance(ask(core, LeaseReturn(0, grant.lease_id, [p.prompt_id for p in grant.prompts[1:]])), Ok)
    assert core.state.dispenser.outstanding == 1
    stats = ask(core, StatsRequest())
    assert isinstance(stats, BufferStats) and stats.counters["prompts_reissued"] == 2
    with pytest.raises(RequestRejected, match="belongs to generator 0"):
        core.handle(LeaseReturn(1, grant.lease_id, [grant.prompts[0].prompt_id]), "me", "test", 0.0)


def test_exhausted_after_the_last_epoch() -> None:
    core = make_core(prompts=3, epochs=1, max_staleness=5)
    grant = lease(core, 8)
    assert len(grant.prompts) == 3
    assert ask(core, LeaseRequest(0, 2, 0)).reason == "full"  # prompts outstanding may still come back
    push_all(core, grant)
    assert ask(core, LeaseRequest(0, 2, 0)).reason == "exhausted"


# ------------------------------------------------------------------------------------------------ properties
OPS = random_ops()


@settings(max_examples=300, deadline=None)
@given(
    ops=OPS,
    eta=st.integers(0, 2),
    reuse=st.integers(1, 2),
    sampling=st.sampled_from(["fifo", "uniform"]),
    capacity_groups=st.integers(2, 8),
    world_size=st.sampled_from([1, 2]),
)
def test_ledger_balances_and_no_served_sample_exceeds_eta(
    ops, eta, reuse, sampling, capacity_groups, world_size
) -> None:
    """Random interleavings of leases, out-of-order pushes, resends, bad groups, learner steps, weight syncs,
    clock jumps (expiries) and returns: after every message the books balance, and `RandomRun.learn` asserts
    that no served sample is staler than η."""
    core = make_core(
        prompts=12,
        max_staleness=eta,
        max_reuse=reuse,
        sampling=sampling,
        capacity=capacity_groups * GROUP,
        groups_per_step=2,
        heartbeat_timeout_s=50.0,
    )
    run = RandomRun(core, world_size)
    for op, pick in ops:
        run.play(op, pick)
        assert core.state.ledger.gap(core.state.replay.samples, len(core.state.replay)) == (0, 0)
        counters = core.counters()
        outflows = ("trained", "dropped_stale", "dropped_no_signal", "evicted", "rejected", "buffered")
        assert counters["arrived"] == sum(counters[k] for k in outflows)
        assert counters["arrived_groups"] == sum(counters[f"{k}_groups"] for k in outflows)
        assert counters["admitted"] == sum(counters[k] for k in ("trained_groups", "buffered_groups", "outstanding"))
        assert counters["buffered"] <= capacity_groups * GROUP
    counters = core.counters()
    event(
        f"served >= {min(counters['served_groups'], 4)}, dropped >= {min(counters['dropped_stale_groups'], 1)}, "
        f"evicted >= {min(counters['evicted_groups'], 1)}, expired >= {min(counters['leases_expired'], 1)}"
    )


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["lease", "push", "push", "learn", "sync"]), st.integers(0, 99)),
        min_size=30,
        max_size=150,
    ),
    eta=st.integers(0, 2),
)
def test_fifo_in_order_admission_never_needs_the_filter(ops, eta) -> None:
    """Groups pushed in the order they were leased and served FIFO: admission alone keeps every sample
    within η, so the draw-time filter never drops anything."""
    core = make_core(prompts=50, max_staleness=eta, capacity=400, groups_per_step=2)
    run = RandomRun(core)
    for op, pick in ops:
        run.play(op, 0 if op == "push" else pick)  # push the oldest unsent group: admission order
    assert core.counters()["dropped_stale"] == 0
    event(f"served >= {min(core.counters()['served_groups'], 6)}")


def test_learner_resumed_from_an_older_checkpoint_is_not_starved() -> None:
    """A learner trains steps 0..2, dies, resumes from its step-1 checkpoint: admission must open again
    (the groups trained after that checkpoint are not in its timeline any more), not refuse 'full' forever."""
    core = make_core()  # B = 2, η = 1
    for step in range(3):
        grant = lease(core, 2, version=step)
        push_all(core, grant, version=step)
        batch = ask(core, BatchRequest(step, 0, 1, 2, 0.0))
        assert isinstance(batch, Batch) and len(batch.groups) == 2
        ask(core, VersionReport(step + 1, step + 1))
    ask(core, VersionReport(1, 1, resync=True))  # resumed at step 1 with the step-1 weights
    grant = lease(core, 4, version=1)
    assert len(grant.prompts) == 4  # (1 + 1 + 1) * 2 - 1 * 2 trained in the new timeline
    push_all(core, grant, version=1)
    assert isinstance(ask(core, BatchRequest(1, 0, 1, 2, 0.0)), Batch)
    c = core.counters()
    assert c["arrived"] == c["trained"] + c["dropped_stale"] + c["evicted"] + c["rejected"] + c["buffered"]


def test_a_request_held_before_a_batch_of_another_shape_was_drawn_stays_held_and_nothing_raises() -> None:
    """A rank-1-of-2 request waits; then a one-rank request draws step 0: the held one must not take a share of it
    (it raised KeyError out of the core, which ends the buffer service)."""
    core = make_core()
    assert core.handle(BatchRequest(0, 1, 2, 4, 5.0), reply_to="held", sender="a", now=0.0) == []
    push_all(core, lease(core, 2))
    replies = core.handle(BatchRequest(0, 0, 1, 2, 0.0), reply_to="me", sender="b", now=0.0)
    assert [(to, type(m)) for to, m in replies] == [("me", Batch)]
    assert [(to, type(m)) for to, m in core.tick(10.0)] == [("held", BatchNotReady)]
    with pytest.raises(RequestRejected) as refused:
        core.handle(BatchRequest(0, 1, 2, 4, 0.0), reply_to="held", sender="a", now=10.0)
    assert refused.value.kind in ("batch_mismatch", "batch_shape")


def test_a_late_group_for_a_reissued_prompt_is_accepted_once_and_the_second_copy_is_a_counted_duplicate() -> None:
    """Generator 0 is taken for dead (silent past heartbeat_timeout_s = 3 s) and its prompts go to generator 1; long
    after the lease retention (retain_s = lease_timeout_s = 10 s), generator 0's finished group comes back first:
    it is accepted (first wins: finished work is refused only when it can no longer be trained), and generator 1's
    copy of the same prompt is acked duplicate and counted."""
    core = make_core(prompts=10)
    first = lease(core, 1, generator=0, now=0.0)
    prompt = first.prompts[0]
    ask(core, Heartbeat(1, 0, [], progress=1), now=3.5)
    core.tick(3.5)
    assert core.counters()["leases_expired"] == 1 and core.counters()["generators_lost"] == 1
    second = lease(core, 1, generator=1, now=3.5)
    assert second.prompts[0].prompt_id == prompt.prompt_id  # re-issued first
    for t in range(4, 60, 2):  # generator 1 keeps its lease alive by heartbeats
        ask(core, Heartbeat(1, 0, [second.lease_id], progress=t), now=float(t))
        core.tick(float(t))
    late = ask(core, make_group(first.lease_id, prompt, generator_id=0), now=60.0)
    assert late.status == "accepted"
    copy = ask(core, make_group(second.lease_id, second.prompts[0], generator_id=1), now=61.0)
    assert copy.status == "duplicate"
    counters = core.counters()
    assert counters["duplicates"] == 1 and counters["arrived_groups"] == 1 and counters["rejected"] == 0
