"""Prompt leases: the dataset cursor, epochs, re-issue of unfinished prompts, and generator liveness.

    dispenser = PromptDispenser(prompts, seed=0, epochs=0, lease_timeout_s=300, heartbeat_timeout_s=30,
                                stall_timeout_s=600)
    grant = dispenser.take(generator_id=0, policy_version=3, count=8, now=time.time())   # a plain record, or None
    dispenser.open(grant)                           # the lease is outstanding (also how a journal replays it)
    dispenser.heartbeat(generator_id, lease_ids, progress, now)   # alive: renews its leases
    outcome = dispenser.complete(lease_id, prompt_id)   # True: first group for that prompt; False: duplicate
    dispenser.expire(dispenser.due(now), now)           # holder dead, stuck, or lease never renewed: re-issue

Liveness is not speed. A lease bounds how long a *dead* or *stuck* generator holds prompts, never how long a live
one may take to finish them:
  dead     no message from the generator for `heartbeat_timeout_s` (its heartbeats come from a thread of their own,
           whatever one engine step or environment call takes: `actors.liveness`);
  stuck    heartbeats come, but the progress counter they carry (engine steps that ran a request, samples
           finished, environment calls answered) has not moved for `stall_timeout_s` while the generator holds a lease;
  orphan   a lease no heartbeat listed for `lease_timeout_s` (its deadline; every heartbeat that lists it, from a
           generator that is not stuck, moves the deadline to now + lease_timeout_s).

A prompt *instance* is (epoch, prompt_id). Epochs are exact: epoch e serves every prompt once, in the
permutation `default_rng((seed, e)).permutation(n)` (the same for a given seed), then epoch e + 1 starts;
after `epochs` passes (0 = unlimited) the dispenser is exhausted. An instance is *live* from the moment it
is leased until its first group is accepted; while live it is held by exactly one active lease, or queued for
re-issue (expired lease, dead generator, returned, or its group rejected). Re-issued instances go to the front
of the queue, before the cursor moves on. No instance is lost and none is completed twice.

Ended leases (closed when every prompt came back, or expired) are kept for `retain_s` so that a group re-sent
after a lost ack, or a late group from an expired lease, is recognised: it is accepted if its instance is
still live (and any other lease holding it is relieved of it), a duplicate otherwise. An ended lease is kept past
`retain_s` for as long as one of its instances is still live (re-issued, not yet completed by anyone), so that
finished work for it is never refused as "unknown": the first group to come back wins.

All times are unix seconds (`now` is passed in, so tests control the clock). A lease never holds the same
prompt id twice (group ids are (lease_id, prompt_id)), so a lease over a tiny dataset may be shorter than asked.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from buffers.prompt_order import EpochOrder, PromptOrder
from common.types import PromptItem

ACTIVE, EXPIRED, CLOSED = "active", "expired", "closed"


class PromptRecordLike(Protocol):
    prompt_id: int
    messages: list[dict[str, str]]
    metadata: dict[str, Any]


@dataclass
class Lease:
    """Prompts handed to one generator; `pending` are those whose group has not come back (while active)."""

    lease_id: int
    generator_id: int
    policy_version: int
    deadline: float
    prompts: dict[int, int]  # prompt_id -> epoch, every prompt ever in this lease
    pending: set[int] = field(default_factory=set)
    state: str = ACTIVE
    ended_at: float = 0.0

    def to_record(self) -> list[Any]:
        return [
            self.lease_id,
            self.generator_id,
            self.policy_version,
            self.deadline,
            [[pid, epoch] for pid, epoch in self.prompts.items()],
            sorted(self.pending),
            self.state,
            self.ended_at,
        ]

    @classmethod
    def from_record(cls, record: list[Any]) -> Lease:
        lease_id, generator_id, version, deadline, prompts, pending, state, ended_at = record
        return cls(lease_id, generator_id, version, deadline, {p: e for p, e in prompts}, set(pending), state, ended_at)


class PromptDispenser:
    """Owns the cursor (its `order`), the re-issue queue and the leases. Not thread-safe; every method is
    O(lease size) except `due` and `forget_ended` (O(leases))."""

    def __init__(
        self,
        prompts: Sequence[PromptRecordLike],
        seed: int,
        epochs: int,
        lease_timeout_s: float,
        heartbeat_timeout_s: float,
        retain_s: float | None = None,
        stall_timeout_s: float = float("inf"),
        order: PromptOrder | None = None,
    ) -> None:
        """`order`: the fresh instances' order (None: `EpochOrder(prompt ids, seed, epochs)`)."""
        if not prompts:
            raise ValueError("prompts: the dataset is empty (check env.kind / env.source / env.num_prompts)")
        self.records = {record.prompt_id: record for record in prompts}
        if len(self.records) != len(prompts):
            raise ValueError("prompts: prompt_id values must be unique")
        self.prompt_ids = [record.prompt_id for record in prompts]
        self.seed, self.epochs = seed, epochs
        self.lease_timeout_s, self.heartbeat_timeout_s = lease_timeout_s, heartbeat_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.retain_s = max(lease_timeout_s, heartbeat_timeout_s) if retain_s is None else retain_s
        self.order = order if order is not None else EpochOrder(self.prompt_ids, seed, epochs)
        self.next_lease_id = 1
        self.queue: deque[tuple[int, int]] = deque()  # (epoch, prompt_id) to re-issue first; may hold stale keys
        self.live: dict[tuple[int, int], int | None] = {}  # instance -> holding lease id, None = queued
        self.leases: dict[int, Lease] = {}  # active and recently ended
        self.last_seen: dict[int, float] = {}  # generator_id -> unix time of its last message
        self.progress: dict[int, tuple[int, float]] = {}  # generator_id -> (progress counter, when it last moved)
        self.outstanding = 0  # prompts pending in active leases

    # ------------------------------------------------------------------------------------------ the cursor
    @property
    def epoch(self) -> int:
        return self.order.epoch

    @property
    def cursor_exhausted(self) -> bool:
        return self.order.exhausted

    @property
    def queued(self) -> int:
        return sum(1 for holder in self.live.values() if holder is None)

    @property
    def exhausted(self) -> bool:
        """Nothing left to lease now (every epoch issued and nothing queued for re-issue)."""
        return self.cursor_exhausted and self.queued == 0

    @property
    def finished(self) -> bool:
        """Every epoch served and every instance came back: nothing will ever be leased again."""
        return self.cursor_exhausted and not self.live

    # ------------------------------------------------------------------------------------------ leasing
    def take(self, generator_id: int, policy_version: int, count: int, now: float) -> dict[str, Any] | None:
        """Choose up to `count` instances (the re-issue queue first, then the cursor) for a new lease.

        Returns the grant as a plain record, or None if nothing is available. The chosen keys are popped from
        the queue: the caller must `open` the grant (after writing it to the journal).
        """
        chosen: list[tuple[int, int]] = []
        in_lease: set[int] = set()
        blocked = False  # the next instance's prompt id is already in this lease: stop here, keep the order
        while self.queue and len(chosen) < count:
            key = self.queue[0]
            if self.live.get(key, -1) is not None or key in chosen:  # stale entry: re-issued or completed
                self.queue.popleft()
                continue
            if key[1] in in_lease:
                blocked = True
                break
            chosen.append(self.queue.popleft())
            in_lease.add(key[1])
        cursor = self.order.cursor  # unchanged unless the order draws
        if not blocked and len(chosen) < count:
            fresh, cursor = self.order.draw(count - len(chosen), in_lease, self.live)
            chosen += fresh
        if not chosen:
            return None
        return {
            "lease_id": self.next_lease_id,
            "generator_id": generator_id,
            "policy_version": policy_version,
            "deadline": now + self.lease_timeout_s,
            "granted_at": now,
            "prompts": [[pid, e] for e, pid in chosen],
            "cursor": cursor,
        }

    def open(self, grant: dict[str, Any]) -> Lease:
        """Make a grant outstanding: its instances become live in this lease, the cursor moves past them."""
        prompts = {pid: epoch for pid, epoch in grant["prompts"]}
        lease = Lease(
            grant["lease_id"], grant["generator_id"], grant["policy_version"], grant["deadline"], prompts, set(prompts)
        )
        for pid, epoch in prompts.items():
            self.live[(epoch, pid)] = lease.lease_id
        self.leases[lease.lease_id] = lease
        self.order.advance(grant["cursor"], prompts)
        self.next_lease_id = max(self.next_lease_id, lease.lease_id + 1)
        self.outstanding += len(prompts)
        if "granted_at" in grant:  # a new lease restarts its holder's stall clock (records written before: no)
            value = self.progress.get(lease.generator_id, (0, 0.0))[0]
            self.progress[lease.generator_id] = (value, max(grant["granted_at"], self._moved_at(lease.generator_id)))
        return lease

    def items(self, lease: Lease) -> list[PromptItem]:
        """The prompts of a lease as they travel to the generator (chats; the generator renders them)."""
        return [
            PromptItem(pid, epoch, self.records[pid].messages, self.records[pid].metadata)
            for pid, epoch in lease.prompts.items()
        ]

    # ------------------------------------------------------------------------------------------ groups
    def check(self, lease_id: int, prompt_id: int, generator_id: int, epoch: int) -> tuple[str, str] | None:
        """(kind, reason) if a group for (lease_id, prompt_id) breaks the lease, else None."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return "unknown_lease", (
                f"lease {lease_id} is unknown (never issued, or ended more than {self.retain_s:.0f}s ago)"
            )
        if lease.generator_id != generator_id:
            return "wrong_generator", f"lease {lease_id} belongs to generator {lease.generator_id}, not {generator_id}"
        if prompt_id not in lease.prompts:
            return "prompt_not_in_lease", f"prompt {prompt_id} is not part of lease {lease_id}"
        if lease.prompts[prompt_id] != epoch:
            return "wrong_epoch", (
                f"prompt {prompt_id} of lease {lease_id} is from epoch {lease.prompts[prompt_id]}, not {epoch}"
            )
        return None

    def complete(self, lease_id: int, prompt_id: int, now: float) -> bool:
        """Mark the instance behind (lease_id, prompt_id) done: True the first time, False for a duplicate.

        Whichever lease holds the instance now (this one, or the one it was re-issued to) is relieved of it;
        an active lease with nothing pending closes. `check` must have passed.
        """
        key = (self.leases[lease_id].prompts[prompt_id], prompt_id)
        if key not in self.live:
            return False
        holder = self.live.pop(key)
        if holder is not None:
            self._release(self.leases[holder], prompt_id, now)
        return True

    def requeue(self, lease_id: int, prompt_ids: Sequence[int], now: float) -> int:
        """Send back the still-pending prompts of an active lease to the front of the queue; returns how many."""
        lease = self.leases[lease_id]
        back = [pid for pid in prompt_ids if pid in lease.pending and lease.state == ACTIVE]
        for pid in reversed(back):
            key = (lease.prompts[pid], pid)
            self.live[key] = None
            self.queue.appendleft(key)
        for pid in back:
            self._release(lease, pid, now)
        return len(back)

    def _release(self, lease: Lease, prompt_id: int, now: float) -> None:
        if prompt_id in lease.pending and lease.state == ACTIVE:
            lease.pending.discard(prompt_id)
            self.outstanding -= 1
            if not lease.pending:
                lease.state, lease.ended_at = CLOSED, now

    # ------------------------------------------------------------------------------------------ liveness
    def seen(self, generator_id: int, now: float) -> None:
        """A message came from this generator: it is alive."""
        self.last_seen[generator_id] = max(now, self.last_seen.get(generator_id, now))

    def heartbeat(self, generator_id: int, lease_ids: Sequence[int], progress: int, now: float) -> None:
        """A heartbeat: the generator is alive, its progress counter is `progress`; the active leases it lists (its
        own: the caller checked) get a new deadline, now + lease_timeout_s, unless the generator is stuck."""
        self.seen(generator_id, now)
        value, moved_at = self.progress.get(generator_id, (progress, now))
        if progress != value or generator_id not in self.progress:
            moved_at = now
        self.progress[generator_id] = (progress, moved_at)
        if not self.making_progress(generator_id, now):
            return
        for lease_id in lease_ids:
            lease = self.leases.get(lease_id)
            if lease is not None and lease.state == ACTIVE and lease.generator_id == generator_id:
                lease.deadline = max(lease.deadline, now + self.lease_timeout_s)

    def making_progress(self, generator_id: int, now: float) -> bool:
        """Its progress counter moved within stall_timeout_s (or it holds nothing yet that started the clock)."""
        return now - self.progress.get(generator_id, (0, now))[1] <= self.stall_timeout_s

    def _moved_at(self, generator_id: int) -> float:
        return self.progress.get(generator_id, (0, 0.0))[1]

    def due(self, now: float) -> list[int]:
        """Active leases to expire now: their generator is dead or stuck, or no heartbeat renewed them in time."""
        lost = set(self.dead_generators(now)) | set(self.stalled_generators(now))
        return [
            lease.lease_id
            for lease in self.leases.values()
            if lease.state == ACTIVE and (lease.deadline < now or lease.generator_id in lost)
        ]

    def why_due(self, lease_id: int, now: float) -> str:
        """Why `due` returned this lease, for the log: 'silent', 'stuck' or 'deadline'."""
        generator_id = self.leases[lease_id].generator_id
        if generator_id in self.dead_generators(now):
            return "silent"
        return "stuck" if generator_id in self.stalled_generators(now) else "deadline"

    def holders(self) -> set[int]:
        """Generators that hold an active lease."""
        return {lease.generator_id for lease in self.leases.values() if lease.state == ACTIVE}

    def dead_generators(self, now: float) -> list[int]:
        """Generators silent for longer than heartbeat_timeout_s."""
        return [gid for gid, seen in self.last_seen.items() if now - seen > self.heartbeat_timeout_s]

    def stalled_generators(self, now: float) -> list[int]:
        """Generators that hold an active lease and whose progress counter has not moved for stall_timeout_s."""
        holding = self.holders()
        return [
            gid for gid, (_, moved) in self.progress.items() if gid in holding and now - moved > self.stall_timeout_s
        ]

    def expire(self, lease_ids: Sequence[int], now: float) -> int:
        """Expire these active leases; their pending prompts go to the front of the queue. Returns how many."""
        requeued = 0
        for lease_id in lease_ids:
            lease = self.leases[lease_id]
            requeued += self.requeue(lease_id, sorted(lease.pending, key=list(lease.prompts).index), now)
            lease.state, lease.ended_at = EXPIRED, now
        return requeued

    def forget(self, now: float) -> None:
        """Drop ended leases older than `retain_s` (but none with an instance still live: a late group for it is
        still wanted) and generators silent with no active lease."""
        ended = [
            i
            for i, x in self.leases.items()
            if x.state != ACTIVE
            and now - x.ended_at > self.retain_s
            and not any((epoch, pid) in self.live for pid, epoch in x.prompts.items())
        ]
        for lease_id in ended:
            del self.leases[lease_id]
        holding = self.holders()
        for gid in self.dead_generators(now):
            if gid not in holding:
                del self.last_seen[gid]
                self.progress.pop(gid, None)

    # ------------------------------------------------------------------------------------------ persistence
    def snapshot(self) -> dict[str, Any]:
        """The whole state as plain values (for the journal); `restore` is its inverse."""
        queued, seen = [], set()
        for key in self.queue:
            if self.live.get(key, -1) is None and key not in seen:
                queued.append(list(key))
                seen.add(key)
        return {
            "num_prompts": len(self.prompt_ids),
            "seed": self.seed,
            **self.order.snapshot(),
            "next_lease_id": self.next_lease_id,
            "queued": queued,
            "leases": [lease.to_record() for lease in self.leases.values()],
        }

    def restore(self, snapshot: dict[str, Any], now: float) -> None:
        """Replace the state by a snapshot; every generator holding a lease gets a fresh heartbeat window."""
        if snapshot["num_prompts"] != len(self.prompt_ids) or snapshot["seed"] != self.seed:
            raise ValueError(
                f"journal: written for {snapshot['num_prompts']} prompts with seed {snapshot['seed']}, but this run "
                f"has {len(self.prompt_ids)} prompts with seed {self.seed}: use another run.name or delete the journal"
            )
        self.order.restore(snapshot)
        self.next_lease_id = snapshot["next_lease_id"]
        self.leases = {record[0]: Lease.from_record(record) for record in snapshot["leases"]}
        self.queue = deque(tuple(key) for key in snapshot["queued"])
        self.live = {tuple(key): None for key in snapshot["queued"]}
        self.outstanding = 0
        for lease in self.leases.values():
            if lease.state == ACTIVE:
                self.live.update({(lease.prompts[pid], pid): lease.lease_id for pid in lease.pending})
                self.outstanding += len(lease.pending)
        self.refresh_generators(now)

    def refresh_generators(self, now: float) -> None:
        """After a restart: every generator holding an active lease is presumed alive, and making progress, as of
        `now`."""
        active = [lease for lease in self.leases.values() if lease.state == ACTIVE]
        self.last_seen = {lease.generator_id: now for lease in active}
        self.progress = {lease.generator_id: (0, now) for lease in active}

    def restart(self, now: float) -> None:
        """After a buffer restart (the journal replayed): `refresh_generators`, and every active lease gets a fresh
        deadline, since heartbeats renewed them without a journal record and the recorded deadlines are old."""
        self.refresh_generators(now)
        for lease in self.leases.values():
            if lease.state == ACTIVE:
                lease.deadline = max(lease.deadline, now + self.lease_timeout_s)
