"""The journal: CRC-framed records, a torn or corrupt tail detected and truncated, compaction by atomic rewrite;
and a restarted state equal to the one that wrote the journal (contents, use counts, leases, cursor, batches,
ledger), before and after compaction."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import event, given, settings
from hypothesis import strategies as st

from buffers.checks import group_problem
from buffers.core import BufferCore
from buffers.journal import Journal, pack_record, read_records
from common.types import Batch, BatchRequest, LeaseRequest
from tests.buffers.fakes import (
    GROUP,
    HOSTILE,
    OP_MIX,
    RandomRun,
    ask,
    hostile_group,
    make_core,
    make_group,
    random_ops,
    without_deadlines,
)


def _write(path: Path, records: list) -> Journal:
    journal = Journal(path)
    assert journal.replay() == []
    for kind, meta, frames in records:
        journal.append(kind, meta, frames)
    return journal


def test_records_round_trip_with_frames(tmp_path: Path) -> None:
    payload = np.arange(1000, dtype=np.int32)
    _write(tmp_path / "j.bin", [("a", {"x": 1}, []), ("b", {"y": [1, 2]}, [b"hello", payload])]).close()
    records = Journal(tmp_path / "j.bin").replay()
    assert [(r.kind, r.meta) for r in records] == [("a", {"x": 1}), ("b", {"y": [1, 2]})]
    assert bytes(records[1].frames[0]) == b"hello"
    assert np.array_equal(np.frombuffer(records[1].frames[1], np.int32), payload)


def test_torn_tail_is_dropped_and_appending_resumes(tmp_path: Path) -> None:
    path = tmp_path / "j.bin"
    _write(path, [("a", {"i": i}, [b"x" * 100]) for i in range(3)]).close()
    full = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(full - 7)  # a crash in mid-write
    journal = Journal(path)
    assert [r.meta["i"] for r in journal.replay()] == [0, 1]
    assert path.stat().st_size == full // 3 * 2  # truncated to the last good record
    journal.append("a", {"i": 9})
    journal.close()
    assert [r.meta["i"] for r in Journal(path).replay()] == [0, 1, 9]


def test_corrupt_record_is_detected_by_its_crc(tmp_path: Path) -> None:
    path = tmp_path / "j.bin"
    _write(path, [("a", {"i": i}, [b"y" * 64]) for i in range(3)]).close()
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # flip a bit inside the last record's frame
    records, good, problem = read_records(bytes(data))
    assert [r.meta["i"] for r in records] == [0, 1] and "CRC" in problem and good == len(data) // 3 * 2
    header_only = b"".join(bytes(p) for p in pack_record("a", {}))[:5]
    assert read_records(header_only)[2].startswith("torn")


def _fingerprint(core: BufferCore) -> dict:
    state = core.state
    book = state.book
    return {
        "counters": core.counters(),
        "buffered": [
            (e.seq, e.uses, e.group.group_id, e.group.completion_tokens.tobytes())
            for e in state.replay.entries.values()
        ],
        "dispenser": without_deadlines(state.dispenser.snapshot()),
        "live": state.dispenser.live,
        "drawn": {s: (b.seqs, sorted(b.delivered), [g.group_id for g in b.groups]) for s, b in book.drawn.items()},
        "completed": None if book.completed is None else (book.completed.step, book.completed.seqs),
        "versions": (state.learner_version, state.policy_version, state.next_seq),
    }


def _restart(settings_: dict, path: Path, now: float) -> BufferCore:
    core = make_core(prompts=12, journal=Journal(path), **settings_)
    core.state.restore(now)
    return core


def _journaled_run(tmp: Path, reuse: int, world_size: int) -> tuple[dict[str, Any], Path, Any, RandomRun]:
    """A core restored from (and journaling to) `tmp`/journal.bin, with a random run over it: (the settings a restart
    needs, the journal's path, the core, the run)."""
    settings_ = {"max_staleness": 1, "max_reuse": reuse, "capacity": 6 * GROUP, "heartbeat_timeout_s": 50.0}
    path = tmp / "journal.bin"
    core = make_core(prompts=12, journal=Journal(path), **settings_)
    core.state.restore(0.0)
    return settings_, path, core, RandomRun(core, world_size)


@settings(max_examples=100, deadline=None)
@given(
    ops=random_ops(10, 100),
    reuse=st.integers(1, 2),
    world_size=st.sampled_from([1, 2]),
    half_step=st.booleans(),
)
def test_restart_from_the_journal_restores_the_state_exactly(ops, reuse, world_size, half_step) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        settings_, path, core, run = _journaled_run(Path(tmp), reuse, world_size)
        for op, pick in ops:
            run.play(op, pick)
        if half_step and world_size == 2:  # leave a drawn batch that rank 1 has not received yet
            ask(core, BatchRequest(core.state.learner_version, 0, 2, 2, 0.0), run.now)
        core.state.save_counters()
        before = _fingerprint(core)
        core.state.journal.close()

        restarted = _restart(settings_, path, run.now)
        assert _fingerprint(restarted) == before
        restarted.state.compact(run.now)
        restarted.state.journal.close()
        compacted = _restart(settings_, path, run.now)
        assert _fingerprint(compacted) == before
        # the restarted buffer carries on: a rank that had not received its share gets the one that was drawn
        for step, batch in list(compacted.state.book.drawn.items()):
            for rank in set(range(batch.world_size)) - batch.delivered:
                share = ask(compacted, BatchRequest(step, rank, batch.world_size, batch.num_groups, 0.0), run.now)
                assert isinstance(share, Batch) and [g.group_id for g in share.groups] == [
                    g.group_id for g in batch.share(rank)[0]
                ]
        compacted.state.journal.close()


def test_compaction_keeps_the_journal_bounded(tmp_path: Path) -> None:
    path = tmp_path / "journal.bin"
    core = make_core(prompts=30, journal=Journal(path, min_compact_bytes=20_000), max_staleness=1000)
    core.state.restore(0.0)
    run = RandomRun(core)
    sizes = []
    for i in range(600):
        run.play(["lease", "push", "push", "learn"][i % 4], i)
        core.tick(run.now)
        sizes.append(path.stat().st_size)
    assert core.counters()["trained_groups"] > 100
    assert core.state.journal.compacted_size > 0 and max(sizes) < 60_000  # uncompacted: > 100 kB
    before = _fingerprint(core)
    core.state.journal.close()
    restarted = make_core(prompts=30, journal=Journal(path), max_staleness=1000)
    restarted.state.restore(run.now)
    assert _fingerprint(restarted) == before


def _hostile_push(core: BufferCore, run: RandomRun, how: str) -> bool:
    """Store a hostile group the way the buffer did before its content checks: past the checks, through `accept`."""
    if not run.unsent:
        return False
    lease_id, prompt, generator, version = run.unsent.pop()
    core.state.accept(hostile_group(lease_id, prompt, how, generator, size=GROUP, version=version), run.now)
    return True


def _hostile_held(core: BufferCore) -> int:
    """Groups held (buffered, or in a drawn batch) that the buffer's checks reject."""
    state = core.state
    held = [e.group for e in state.replay.entries.values()]
    held += [g for b in [*state.book.drawn.values(), state.book.completed] if b is not None for g in b.groups]
    return sum(group_problem(g, state.settings.group_limits, state.newest_version) is not None for g in held)


def _assert_nothing_hostile_held(core: BufferCore) -> None:
    state = core.state
    assert _hostile_held(core) == 0
    assert state.ledger.gap(state.replay.samples, len(state.replay)) == (0, 0), core.counters()


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from([*OP_MIX, "hostile", "compact"]), st.integers(0, 1 << 16)), min_size=10, max_size=80
    ),
    how=st.sampled_from(sorted(HOSTILE)),
    reuse=st.integers(1, 2),
    world_size=st.sampled_from([1, 2]),
)
def test_hostile_groups_journaled_before_the_checks_are_skipped_on_replay(ops, how, reuse, world_size) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        settings_, path, core, run = _journaled_run(Path(tmp), reuse, world_size)
        for op, pick in ops:
            if op == "hostile":
                _hostile_push(core, run, how)
            elif op == "compact":
                core.state.compact(run.now)
            else:
                run.play(op, pick)
        core.state.save_counters()
        core.state.journal.close()
        hostile = _hostile_held(core)  # those that were trained, dropped or evicted before the restart are gone
        event(f"hostile groups held at the restart: {min(hostile, 2)}")

        restarted = _restart(settings_, path, run.now)
        _assert_nothing_hostile_held(restarted)
        assert restarted.counters().get("journal_skipped", 0) >= min(hostile, 1)
        # it carries on: more groups and learner steps, still balanced and clean
        run.core = restarted
        for i in range(30):
            run.play(["lease", "push", "push", "learn", "time"][i % 5], i)
            _assert_nothing_hostile_held(restarted)
        restarted.state.journal.close()


def test_a_version_report_journaled_with_a_step_of_2_63_is_skipped_on_replay(tmp_path: Path) -> None:
    """The old buffer journaled VersionReport(0, 2**63), then died at its next TensorBoard write, at every restart."""
    from common.metrics import MetricsSink

    path = tmp_path / "journal.bin"
    core = make_core(prompts=12, journal=Journal(path))
    core.state.restore(0.0)
    core.state.report_version(1, 1)  # a learner at step 1
    core.state.report_version(2**63, 0)  # what the old core committed for that report (it passed its checks then)
    core.state.journal.close()

    restarted = make_core(prompts=12, journal=Journal(path))
    assert restarted.state.restore(0.0) == 1  # every record but the hostile one
    assert restarted.state.learner_version == 1 and restarted.counters()["journal_skipped"] == 1
    sink = MetricsSink(tmp_path, "buffer")
    sink.log(restarted.state.learner_version, restarted.metrics())  # what overflowed TensorBoard before
    sink.close()
    grant = ask(restarted, LeaseRequest(0, 1, 1))
    assert ask(restarted, make_group(grant.lease_id, grant.prompts[0], 0, GROUP, 1)).status == "accepted"
