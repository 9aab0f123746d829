"""Prompt leases: exact, seeded epochs; re-issue after expiry, a dead generator, a return or a rejected group;
late groups from expired leases; no prompt lost or completed twice."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers.leases import PromptDispenser
from tests.buffers.fakes import fake_prompts


def _dispenser(count: int = 10, seed: int = 0, epochs: int = 0, **kwargs) -> PromptDispenser:
    return PromptDispenser(
        fake_prompts(count), seed=seed, epochs=epochs, lease_timeout_s=10.0, heartbeat_timeout_s=3.0, **kwargs
    )


def _lease(dispenser: PromptDispenser, count: int, now: float = 0.0, generator_id: int = 0):
    grant = dispenser.take(generator_id, 0, count, now)
    return None if grant is None else dispenser.open(grant)


def _complete_all(dispenser: PromptDispenser, lease, now: float = 0.0) -> list[tuple[int, int]]:
    done = [(epoch, pid) for pid, epoch in lease.prompts.items()]
    assert all(dispenser.complete(lease.lease_id, pid, now) for pid in lease.prompts)
    return done


def test_epochs_are_exact_and_seeded() -> None:
    dispenser = _dispenser(count=10, seed=3, epochs=2)
    served = []
    while (lease := _lease(dispenser, 4)) is not None:
        served += _complete_all(dispenser, lease)
    assert Counter(epoch for epoch, _ in served) == {0: 10, 1: 10}
    for epoch in (0, 1):
        assert sorted(pid for e, pid in served if e == epoch) == list(range(10))
    assert dispenser.exhausted and dispenser.finished
    order = [pid for e, pid in served]
    again = _dispenser(count=10, seed=3, epochs=2)
    replayed = []
    while (lease := _lease(again, 3)) is not None:
        replayed += [pid for pid in _complete_all_pids(again, lease)]
    assert replayed == order  # same seed, same order, whatever the lease sizes
    other = _dispenser(count=10, seed=4, epochs=1)
    assert [pid for pid in _complete_all_pids(other, _lease(other, 10))] != order[:10]
    assert order[:10] != order[10:]  # each epoch has its own permutation


def _complete_all_pids(dispenser: PromptDispenser, lease) -> list[int]:
    return [pid for _, pid in _complete_all(dispenser, lease)]


def test_a_lease_never_holds_a_prompt_twice() -> None:
    dispenser = _dispenser(count=3)
    lease = _lease(dispenser, 8)
    assert len(lease.prompts) == 3  # the next prompt would be the same prompt of epoch 1
    nxt = _lease(dispenser, 8)
    assert sorted(nxt.prompts) == [0, 1, 2] and set(nxt.prompts.values()) == {1}


def test_expired_lease_is_reissued_first_and_a_late_group_is_still_accepted_once() -> None:
    dispenser = _dispenser(count=10)
    first = _lease(dispenser, 3, now=0.0)
    pids = list(first.prompts)
    assert dispenser.complete(first.lease_id, pids[0], now=1.0)
    assert dispenser.due(now=5.0) == [] and dispenser.due(now=11.0) == [first.lease_id]
    assert dispenser.expire([first.lease_id], now=11.0) == 2
    assert dispenser.outstanding == 0
    second = _lease(dispenser, 4, now=12.0, generator_id=1)
    assert list(second.prompts)[:2] == pids[1:]  # re-issued at the front, in their order
    # the late group of the expired lease arrives first: accepted, and the re-issued lease is relieved of it
    assert dispenser.check(first.lease_id, pids[1], 0, 0) is None
    assert dispenser.complete(first.lease_id, pids[1], now=13.0)
    assert dispenser.complete(second.lease_id, pids[1], now=14.0) is False  # duplicate
    assert pids[1] not in second.pending and dispenser.outstanding == 3
    assert dispenser.complete(first.lease_id, pids[0], now=14.0) is False  # resent after a lost ack


def test_silent_generator_loses_its_leases() -> None:
    dispenser = _dispenser(count=10)
    dispenser.seen(0, now=0.0)
    dispenser.seen(1, now=0.0)
    lease0, lease1 = _lease(dispenser, 2, generator_id=0), _lease(dispenser, 2, generator_id=1)
    dispenser.seen(1, now=2.5)
    assert dispenser.due(now=3.5) == [lease0.lease_id]  # generator 0 silent for > 3 s, well before the deadline
    assert dispenser.dead_generators(now=3.5) == [0]
    dispenser.expire(dispenser.due(now=3.5), now=3.5)
    dispenser.forget(now=3.5)
    assert 0 not in dispenser.last_seen and lease1.state == "active"
    assert dispenser.queued == 2


def test_heartbeats_renew_a_live_generators_leases_however_long_its_rollouts_take() -> None:
    """lease_timeout_s = 10: a lease listed by heartbeats that show progress never expires (here for 100 s)."""
    dispenser = _dispenser(count=10, stall_timeout_s=20.0)
    lease = _lease(dispenser, 2, now=0.0)
    for t in range(2, 100, 2):
        dispenser.heartbeat(0, [lease.lease_id], progress=t, now=float(t))
        assert dispenser.due(now=t + 0.5) == []
    assert lease.deadline == 98.0 + 10.0 and lease.state == "active"
    # a heartbeat that does not list the lease leaves its deadline alone: it expires as an orphan
    for t in range(100, 110, 2):
        dispenser.heartbeat(0, [], progress=t, now=float(t))
    assert dispenser.due(now=108.5) == [lease.lease_id] and dispenser.why_due(lease.lease_id, 108.5) == "deadline"


def test_a_generator_that_heartbeats_without_progress_is_stuck() -> None:
    dispenser = _dispenser(count=10, stall_timeout_s=20.0)
    lease = _lease(dispenser, 2, now=0.0)
    for t in range(2, 40, 2):  # alive (never silent for 3 s), but its counter stands at 7 from t = 2 on
        dispenser.heartbeat(0, [lease.lease_id], progress=7, now=float(t))
    assert dispenser.dead_generators(now=38.5) == []
    assert dispenser.stalled_generators(now=21.0) == [] and dispenser.stalled_generators(now=22.5) == [0]
    assert dispenser.due(now=22.5) == [lease.lease_id] and dispenser.why_due(lease.lease_id, 22.5) == "stuck"
    # a stuck generator's heartbeats no longer renew: the deadline stayed where the last renewal (t = 22) left it
    assert lease.deadline == 22.0 + 10.0


def test_a_new_lease_restarts_the_stall_clock() -> None:
    dispenser = _dispenser(count=10, stall_timeout_s=20.0)
    dispenser.heartbeat(0, [], progress=3, now=0.0)  # idle for a long time: no lease, not stuck
    dispenser.heartbeat(0, [], progress=3, now=50.0)
    lease = _lease(dispenser, 2, now=50.0)
    dispenser.heartbeat(0, [lease.lease_id], progress=3, now=52.0)
    assert dispenser.stalled_generators(now=69.0) == [] and dispenser.stalled_generators(now=71.0) == [0]


def test_a_late_group_for_a_reissued_prompt_is_wanted_past_the_retention() -> None:
    """The expired lease is kept while one of its prompts is re-issued and not completed: its late group is accepted
    (first wins) however late, and the re-issued copy is a duplicate; once nothing of it is live it is forgotten."""
    dispenser = _dispenser(count=10, retain_s=5.0)
    first = _lease(dispenser, 2, now=0.0)
    pids = list(first.prompts)
    dispenser.expire([first.lease_id], now=11.0)
    second = _lease(dispenser, 2, now=12.0, generator_id=1)
    dispenser.forget(now=500.0)
    assert first.lease_id in dispenser.leases
    assert dispenser.check(first.lease_id, pids[0], 0, 0) is None
    assert dispenser.complete(first.lease_id, pids[0], now=500.0)
    assert dispenser.complete(second.lease_id, pids[0], now=501.0) is False  # the second copy: a duplicate
    assert dispenser.complete(second.lease_id, pids[1], now=502.0)
    dispenser.forget(now=503.0)
    assert first.lease_id not in dispenser.leases  # nothing of it is live any more


def test_a_restart_gives_active_leases_a_fresh_deadline() -> None:
    dispenser = _dispenser(count=10)
    lease = _lease(dispenser, 2, now=0.0)
    copy = _dispenser(count=10)
    copy.restore(dispenser.snapshot(), now=500.0)
    assert copy.leases[lease.lease_id].deadline == 10.0  # restored as recorded
    copy.restart(now=500.0)  # heartbeats renewed it without a record: presume it alive as of the restart
    assert copy.leases[lease.lease_id].deadline == 510.0 and copy.due(now=502.0) == []


def test_returned_prompts_go_to_the_front() -> None:
    dispenser = _dispenser(count=10)
    lease = _lease(dispenser, 4)
    pids = list(lease.prompts)
    assert dispenser.requeue(lease.lease_id, [pids[2], pids[3], 99], now=1.0) == 2
    assert lease.pending == set(pids[:2]) and dispenser.outstanding == 2
    assert list(_lease(dispenser, 3).prompts)[:2] == pids[2:]


def test_check_names_what_is_wrong() -> None:
    dispenser = _dispenser(count=10)
    lease = _lease(dispenser, 2, generator_id=5)
    pid = next(iter(lease.prompts))
    assert dispenser.check(99, pid, 5, 0)[0] == "unknown_lease"
    assert dispenser.check(lease.lease_id, pid, 4, 0)[0] == "wrong_generator"
    assert dispenser.check(lease.lease_id, 1000, 5, 0)[0] == "prompt_not_in_lease"
    assert dispenser.check(lease.lease_id, pid, 5, 1)[0] == "wrong_epoch"
    assert dispenser.check(lease.lease_id, pid, 5, 0) is None


def test_ended_leases_are_forgotten_after_retention() -> None:
    dispenser = _dispenser(count=10, retain_s=5.0)
    lease = _lease(dispenser, 2)
    _complete_all(dispenser, lease, now=1.0)
    assert lease.state == "closed"
    dispenser.forget(now=5.5)
    assert lease.lease_id in dispenser.leases
    dispenser.forget(now=6.5)
    assert lease.lease_id not in dispenser.leases


def test_snapshot_restores_the_same_state() -> None:
    dispenser = _dispenser(count=7, seed=2, epochs=3)
    a, b = _lease(dispenser, 3), _lease(dispenser, 3, generator_id=1)
    dispenser.complete(a.lease_id, next(iter(a.prompts)), now=1.0)
    dispenser.expire([b.lease_id], now=2.0)
    copy = _dispenser(count=7, seed=2, epochs=3)
    copy.restore(dispenser.snapshot(), now=3.0)
    assert copy.snapshot() == dispenser.snapshot()
    assert copy.live == dispenser.live and copy.outstanding == dispenser.outstanding
    assert copy.last_seen == {0: 3.0}  # generators holding an active lease get a fresh window
    assert _lease(copy, 5).prompts == _lease(dispenser, 5).prompts  # same queue and cursor: same next lease
    with pytest.raises(ValueError, match="run.name"):
        _dispenser(count=8, seed=2).restore(dispenser.snapshot(), now=0.0)


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["lease", "complete", "expire", "return", "late"]), st.integers(0, 50)), max_size=150
    ),
    epochs=st.integers(1, 3),
)
def test_no_instance_is_lost_or_completed_twice(ops: list, epochs: int) -> None:
    """Random leases, completions, expiries, returns and late groups; then everything left is completed.
    Every (epoch, prompt) is completed exactly once, and `outstanding` always equals the pending prompts."""
    dispenser = _dispenser(count=6, seed=1, epochs=epochs)
    completed: Counter[tuple[int, int]] = Counter()
    now = 0.0
    for op, pick in ops:
        now += 0.1
        leases = list(dispenser.leases.values())
        if op == "lease":
            _lease(dispenser, 1 + pick % 4, now=now, generator_id=pick % 3)
        elif leases:
            lease = leases[pick % len(leases)]
            pid = list(lease.prompts)[pick % len(lease.prompts)]
            if op in ("complete", "late") and (op == "late" or lease.state == "active"):
                if dispenser.complete(lease.lease_id, pid, now):
                    completed[(lease.prompts[pid], pid)] += 1
            elif op == "expire" and lease.state == "active":
                dispenser.expire([lease.lease_id], now)
            elif op == "return" and lease.state == "active":
                dispenser.requeue(lease.lease_id, [pid], now)
        assert dispenser.outstanding == sum(len(x.pending) for x in dispenser.leases.values() if x.state == "active")
    while (lease := _lease(dispenser, 4, now=now)) is not None or dispenser.live:
        if lease is None:  # only pending in active leases remain
            lease = next(x for x in dispenser.leases.values() if x.pending)
        for pid in list(lease.pending):
            assert dispenser.complete(lease.lease_id, pid, now)
            completed[(lease.prompts[pid], pid)] += 1
    assert dispenser.finished
    assert completed == Counter({(e, p): 1 for e in range(epochs) for p in range(6)})
