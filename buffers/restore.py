"""Journal replay that survives records the buffer would refuse now: each is skipped, logged and counted.

    guard = ReplayGuard(state)
    for record in journal.replay(): guard.replay(record)      # applies it, or skips it (guard.skipped counts them)

Why: a journal written before a check existed holds what that check now refuses, e.g. a `VersionReport` whose step
of 2**63 overflowed TensorBoard at every metrics write, so every restart died again; or a group with token ids
outside the vocabulary. Replay applies such records through the same checks as the live path
(`journal_record_problem` for the numbers, `group_problem` for a group's content) and skips the ones that fail.

What a skip does to the state, so that nothing hostile is served and nothing else is lost or counted twice:
- a group record: the group is not buffered; it counts as arrived (as it did live) and rejected, under
  `rejected_<kind>`; its prompt stays pending in its lease, so it is re-issued when the lease ends;
- an eviction or drop that names a skipped group: applied to the others;
- a draw that holds a skipped group: its other groups are used as they were live (their use counts and flows), the
  batch is not restored (a rank that had not received it asks again and gets a new draw); `pending_draw` likewise;
- a delivery of a batch that is not restored: skipped;
- a version record with numbers outside the bounds: skipped (the learner re-reports its version);
- a record whose applier raises (a bug, not a check): skipped as `replay_error`, so that a journal cannot make every
  restart die the same way (live, `BufferState.commit` takes back the record of an event that failed to apply).
The ledger identity holds after replay: `delta` is what the skips changed against the live ledger (a skipped
group's rejection, minus the live flows of that group that replay leaves out), and it is added again after every
`counters` snapshot, which overwrites the ledger with the live values.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from buffers.checks import Problem, group_problem, journal_record_problem
from buffers.journal import Record
from common.wire import WireError, decode

if TYPE_CHECKING:
    from buffers.state import BufferState

log = logging.getLogger("tandem.buffer")


class ReplayGuard:
    """Replays journal records into a fresh `BufferState`, skipping those that fail their checks (module docstring).
    `skipped`: records skipped so far; `delta`: the ledger's difference from the live one's."""

    def __init__(self, state: BufferState) -> None:
        self.state = state
        self.skipped = 0
        self.delta: Counter[str] = Counter()
        self.rejected: dict[int, list[int]] = {}  # seq of a skipped group -> [samples, uses as live counted them]

    def replay(self, record: Record) -> None:
        kind, meta = record.kind, record.meta
        problem = journal_record_problem(kind, meta)
        if problem is None:
            try:
                problem = self._apply(kind, meta, record)
            except Exception as error:  # noqa: BLE001 - a record that breaks replay must not stop every restart
                problem = ("replay_error", f"{type(error).__name__}: {error}"[:300])
        if problem is not None:
            self.skipped += 1
            self._count("journal_skipped")
            log.error("journal: skipped a %s record (%s): %s", kind, *problem)

    def _apply(self, kind: str, meta: dict[str, Any], record: Record) -> Problem:
        """Apply the record (or what of it may be applied); the problem that made it a skip, else None."""
        state = self.state
        if kind == "group":
            return self._group(meta, record)
        if kind in ("evict", "drop"):
            flow = "evicted" if kind == "evict" else "dropped_stale"
            meta = {**meta, "seqs": [s for s in meta["seqs"] if not self._leaves(s, flow)]}
        elif kind == "draw" and any(s in self.rejected for s in meta["seqs"]):
            self._draw_without_batch(meta)
            return "holds_rejected_group", f"the batch of step {meta['step']} held a group skipped before"
        elif kind == "pending_draw" and any(s in self.rejected for s in meta["seqs"]):
            return "holds_rejected_group", f"the batch of step {meta['step']} held a group skipped before"
        elif kind == "deliver" and meta["step"] not in state.book.drawn:
            return "no_batch", f"no batch of step {meta['step']} was restored"
        state.apply(kind, meta)
        if kind == "counters":
            state.ledger.counts.update(self.delta)  # the snapshot holds the live values: re-apply what skips changed
        return None

    def _group(self, meta: dict[str, Any], record: Record) -> Problem:
        state = self.state
        try:
            group, _ = decode(record.frames)
        except WireError as error:
            group, problem = None, ("undecodable", error.reason)
        else:
            problem = group_problem(group, state.settings.group_limits, state.newest_version)
        if problem is None:
            state.apply("group", meta, group)
            return None
        seq = meta["seq"]
        state.next_seq = max(state.next_seq, seq + 1)
        if meta.get("held"):  # only a drawn batch holds it (its flows are complete): that batch is skipped too
            self.rejected[seq] = [0, 0]
            return problem
        # it was accepted live, so it had algo.group_size samples (the size an undecodable one is counted with)
        samples = group.size if group is not None else state.settings.group_size
        if meta.get("complete", True):
            state.ledger.flow("arrived", samples)  # as live; a compacted record's arrival is in the counters
        for key, value in (("rejected", samples), ("rejected_groups", 1), (f"rejected_{problem[0]}", 1)):
            self._count(key, value)
        self.rejected[seq] = [samples, meta.get("uses", 0)]
        return problem

    def _leaves(self, seq: int, flow: str) -> bool:
        """True (and the live flow undone) when `seq` is a skipped group that a live eviction or drop removed."""
        if seq not in self.rejected:
            return False
        samples, _ = self.rejected.pop(seq)
        self.delta.update({flow: -samples, f"{flow}_groups": -1})  # replay never counted it: only the live ledger did
        return True

    def _draw_without_batch(self, meta: dict[str, Any]) -> None:
        """The use counts and flows a live draw gave its groups; the skipped ones' flows are undone instead."""
        state = self.state
        kept = [s for s in meta["seqs"] if s not in self.rejected]
        served, retired = state.replay.use(kept)
        state.ledger.flow("served", sum(e.samples for e in served), len(served))
        state.ledger.flow("trained", sum(e.samples for e in retired), len(retired))
        for seq in (s for s in meta["seqs"] if s in self.rejected):
            samples, uses = self.rejected[seq]
            self.delta.update({"served": -samples, "served_groups": -1})
            if uses + 1 >= state.settings.max_reuse:  # retired live: trained, then never named again
                self.delta.update({"trained": -samples, "trained_groups": -1})
                del self.rejected[seq]
            else:
                self.rejected[seq][1] = uses + 1

    def _count(self, key: str, value: int = 1) -> None:
        """Count in the ledger now and in `delta` (so that a later counters snapshot keeps it)."""
        self.state.ledger.counts[key] += value
        self.delta[key] += value
