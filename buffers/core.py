"""The buffer's answers to every message, without sockets: `handle` maps a request to the replies to send now.

    core = BufferCore(state, wire_rejections=server.rejected)
    replies = core.handle(request.message, reply_to=request, sender=request.sender, now=time.time(), role=request.role)
    for reply_to, message in replies: server.reply(reply_to, message)      # may answer earlier, held requests
    for reply_to, message in core.tick(time.time()): ...                   # expiries, BatchNotReady at timeouts

Once the learner's final report came (VersionReport.final), lease requests and heartbeats are answered
`RunOver`, and `run_over(now)` says when every live generator has heard it (`buffers.run_end`).

A lease request is answered by the first of a chain of grant sources: the run's end (`RunOver`), the extensions
(`buffers.extensions`: optional work beside training, evaluation today, `buffers.eval_extension`), then training
admission. Extensions also answer messages of their own, hear heartbeats and version reports, run at each tick,
add counters, and may hold the run's end. Their leases never count in `_admitted`, are not staleness-checked and
never reach the replay buffer or the ledger.

Dynamic sampling (buffer.filter = "no_signal"): `buffers.no_signal`, asked at admission and at each group's arrival.

Failure modes: a well-formed message the buffer cannot accept (unknown lease, rank >= world_size, a version
from the future, a role that may not send it, a state change out of order: see `buffers.authority`) raises
`RequestRejected(kind, reason)` before anything is committed; the caller answers it with an ErrorReply and
counts it. A rollout group that breaks the contract or its lease is not an error: it is acked "rejected" with
the reason, counted (samples and `rejected_<kind>`) and logged with its sender. Nothing here raises for bad
input otherwise; an exception from here is a bug.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from buffers.authority import draw_problem, heartbeat_lease_problem, role_problem, version_order_problem
from buffers.batches import DrawnBatch
from buffers.checks import (
    RequestRejected,
    batch_request_problem,
    group_problem,
    heartbeat_problem,
    lease_request_problem,
    lease_return_problem,
    version_report_problem,
)
from buffers.curriculum import pass_rate_metrics
from buffers.extensions import CoreExtension, default_extensions
from buffers.lengths import length_metrics
from buffers.no_signal import NoSignalFilter
from buffers.run_end import RunEnd
from buffers.staleness import RETRY_FULL_S, RETRY_STALE_S, Admission, admit
from buffers.state import BufferState
from buffers.traffic import Traffic
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
    RolloutGroup,
    StatsRequest,
    VersionReport,
)

log = logging.getLogger("tandem.buffer")

Reply = tuple[Any, Any]  # (reply_to, message)
RETRY_EXHAUSTED_S = 5.0
MAX_HELD = 64  # held batch requests at once (one per step, rank and connection; a learner holds world_size)


class BufferCore:
    """Message handlers over a `BufferState`; single-threaded (the service's poll loop calls it)."""

    def __init__(
        self,
        state: BufferState,
        wire_rejections: Mapping[str, int] | None = None,
        extensions: list[CoreExtension] | None = None,
    ) -> None:
        """`extensions`: optional work beside training (`buffers.extensions`); default: what `state` was built for."""
        self.state = state
        self.settings = state.settings
        self.wire_rejections = wire_rejections if wire_rejections is not None else {}
        self.capacity_groups = self.settings.capacity // self.settings.group_size
        self.limits = self.settings.group_limits
        self.traffic = Traffic()  # bytes in and out, staleness of served samples (buffers.traffic)
        self.end = RunEnd()  # the learner's final report: generators are answered RunOver (buffers.run_end)
        self.no_signal = NoSignalFilter(state)  # dynamic sampling (buffer.filter = "no_signal")
        self.extensions = default_extensions(state, self.end) if extensions is None else extensions
        self._handlers = {
            LeaseRequest: self._lease_request,
            RolloutGroup: self._group,
            Heartbeat: self._heartbeat,
            LeaseReturn: self._lease_return,
            BatchRequest: self._batch_request,
            VersionReport: self._version_report,
            StatsRequest: self._stats,
        }
        for extension in self.extensions:
            self._handlers.update(extension.handlers)
        self._grant_sources = [self._run_end, *(e.lease_reply for e in self.extensions), self._admission]

    def handle(self, message: Any, reply_to: Any, sender: str, now: float, role: str | None = None) -> list[Reply]:
        """The replies to send now (to this request and to held ones it made answerable); may raise
        RequestRejected. A held BatchRequest gets no reply now (it is answered by a later call or `tick`).
        `role`: the peer's role (`common.sockets.Request.role`), checked against `buffers.authority.PERMITTED`;
        None only for an in-process caller that speaks for itself (tests, tools), which may send anything."""
        handler = self._handlers.get(type(message))
        if handler is None:
            name = getattr(type(message), "WIRE_NAME", type(message).__name__)
            raise RequestRejected("unexpected_message", f"the buffer does not take '{name}' messages")
        if role is not None:
            self._check(role_problem(type(message), role))
        return handler(message, reply_to, sender, now)

    # ------------------------------------------------------------------------------------------ generators
    def _lease_request(self, request: LeaseRequest, reply_to: Any, sender: str, now: float) -> list[Reply]:
        """The first answer of the grant sources: run end, the extensions, training admission (which always answers)."""
        self._check(lease_request_problem(request, self.state.newest_version))
        self.state.dispenser.seen(request.generator_id, now)
        reply = next(r for source in self._grant_sources if (r := source(request, sender, now)) is not None)
        return [(reply_to, reply)]

    def _run_end(self, request: LeaseRequest, sender: str, now: float) -> Any | None:
        """`RunOver` once the learner's final report came and no extension holds the end."""
        return self.end.tell(request.generator_id) if self.end.over and not self._end_held(now) else None

    def _admission(self, request: LeaseRequest, sender: str, now: float) -> LeaseGrant | LeaseRefused:
        """Training prompts as admission control allows (`buffers.staleness`), else the refusal that says why."""
        dispenser = self.state.dispenser
        if dispenser.finished:
            return LeaseRefused("exhausted", 0, RETRY_EXHAUSTED_S)
        admission = self._admit(request)
        if admission.refusal:
            retry = RETRY_STALE_S if admission.refusal == "stale" else RETRY_FULL_S
            return LeaseRefused(admission.refusal, admission.min_version, retry)
        lease = self.state.grant(request.generator_id, request.policy_version, admission.granted, now)
        if lease is None:  # every epoch is issued, but outstanding prompts may still come back for re-issue
            return LeaseRefused("full", admission.min_version, RETRY_FULL_S)
        return LeaseGrant(lease.lease_id, lease.deadline, dispenser.items(lease))

    def _admit(self, request: LeaseRequest) -> Admission:
        """`buffers.staleness.admit`, widened while dynamic sampling filters (`NoSignalFilter.admission`)."""
        settings = self.settings
        v, eta, b = request.policy_version, settings.max_staleness, settings.groups_per_step
        admitted = self._admitted()
        admission = admit(request.max_prompts, v, self.state.learner_version, eta, b, admitted)
        return self.no_signal.admission(request, admission, admitted)

    def _admitted(self) -> int:
        """Groups in the learner's timeline: trained (since a rewind: re-based to V·B) + buffered + outstanding.

        The admission argument numbers groups from the learner's step 0 (group m is trained at step ⌊m/B⌋). A learner
        that resumes from an older checkpoint reports a lower step V; the groups trained after that checkpoint are
        then no longer part of its timeline, and counting them would refuse every lease forever ("full") while the
        learner waits for a batch.
        """
        state = self.state
        trained = state.ledger.counts["trained_groups"] - state.trained_offset
        return trained + len(state.replay) + state.dispenser.outstanding

    def _group(self, group: RolloutGroup, reply_to: Any, sender: str, now: float) -> list[Reply]:
        """Checks in order: the lease (unknown, foreign, wrong prompt or epoch: rejected), the prompt (already
        came back: duplicate), the content (size, versions: rejected, and its prompt is re-issued)."""
        dispenser = self.state.dispenser
        problem = dispenser.check(group.lease_id, group.prompt_id, group.generator_id, group.epoch)
        if problem is None:
            dispenser.seen(group.generator_id, now)
            key = (group.epoch, group.prompt_id)
            if key not in dispenser.live:
                self.state.ledger.event("duplicates")
                return [(reply_to, GroupAck(group.lease_id, group.prompt_id, "duplicate"))]
            problem = group_problem(group, self.limits, self.state.newest_version)
            if problem is not None and dispenser.live[key] == group.lease_id:
                self.state.requeue(group.lease_id, [group.prompt_id], now)  # let another try come
        if problem is not None:
            return [(reply_to, self._reject_group(group, *problem, sender))]
        self.traffic.arrived(group)
        if self.no_signal.drop_if_no_signal(group, now):  # acked "accepted": its prompt is done, as for a stored group
            return [(reply_to, GroupAck(group.lease_id, group.prompt_id, "accepted"))]
        self.state.accept(group, now)
        self.no_signal.warn_if_mostly_filtered()
        return [(reply_to, GroupAck(group.lease_id, group.prompt_id, "accepted")), *self._serve_held(now)]

    def _reject_group(self, group: RolloutGroup, kind: str, reason: str, sender: str) -> GroupAck:
        self.state.ledger.flow("arrived", group.size)
        self.state.ledger.flow("rejected", group.size)
        self.state.ledger.event(f"rejected_{kind}")
        log.warning("rejected group (lease %d, prompt %d) from %s: %s", group.lease_id, group.prompt_id, sender, reason)
        return GroupAck(group.lease_id, group.prompt_id, "rejected", reason)

    def _heartbeat(self, heartbeat: Heartbeat, reply_to: Any, sender: str, now: float) -> list[Reply]:
        self._check(heartbeat_problem(heartbeat, self.state.newest_version))
        leases = self.state.dispenser.leases
        owners = {i: leases[i].generator_id for i in heartbeat.lease_ids if i in leases}
        self._check(heartbeat_lease_problem(heartbeat, owners))
        self.state.dispenser.heartbeat(heartbeat.generator_id, heartbeat.lease_ids, heartbeat.progress, now)
        self.traffic.heard(heartbeat.generator_id, heartbeat.tokens)
        if self.extensions:
            progressing = self.state.dispenser.making_progress(heartbeat.generator_id, now)
            for extension in self.extensions:
                extension.heard(heartbeat, progressing, now)
        if self.end.over and not self._end_held(now):
            return [(reply_to, self.end.tell(heartbeat.generator_id))]
        return [(reply_to, Ok(self.state.learner_version))]

    def _lease_return(self, returned: LeaseReturn, reply_to: Any, sender: str, now: float) -> list[Reply]:
        lease = self.state.dispenser.leases.get(returned.lease_id)
        self._check(
            lease_return_problem(
                returned, None if lease is None else lease.generator_id, set() if lease is None else set(lease.prompts)
            )
        )
        self.state.dispenser.seen(returned.generator_id, now)
        back = [pid for pid in returned.prompt_ids if pid in lease.pending]
        if back:
            self.state.requeue(returned.lease_id, back, now)
            log.info("generator %d returned %d prompts of lease %d", returned.generator_id, len(back), lease.lease_id)
        return [(reply_to, Ok(self.state.learner_version))]

    def _end_held(self, now: float) -> bool:
        """An extension holds the run's end (its work on the final version is not done)."""
        return any(extension.holds_end(now) for extension in self.extensions)

    # ------------------------------------------------------------------------------------------ learners
    def _batch_request(self, request: BatchRequest, reply_to: Any, sender: str, now: float) -> list[Reply]:
        self._check(
            batch_request_problem(request, self.capacity_groups, self.state.learner_version, self.settings.sync_every)
        )
        book = self.state.book
        conflict = book.conflict(request)
        if conflict:
            raise RequestRejected("batch_mismatch", conflict)
        if book.find(request.step) is None:
            self._check(draw_problem(request, self.state.draw_floor, self.state.batch_shape))
        batch = self._serve(request)
        if batch is not None:  # other ranks may be waiting for the batch this request just drew
            return [(reply_to, batch), *self._serve_held(now)]
        if request.timeout_s == 0:
            return [(reply_to, BatchNotReady(request.step, len(self.state.replay)))]
        if len(book.held) >= MAX_HELD and (request.step, request.rank, sender) not in book.held:
            raise RequestRejected("too_many_held", f"{MAX_HELD} batch requests are held already: retry later")
        book.hold(reply_to, request, now + request.timeout_s, sender)
        return []

    def _serve(self, request: BatchRequest) -> Batch | None:
        """This rank's share of the batch of `request.step`, drawing the batch first if nobody has yet (and a draw
        is in order: a held request whose step fell behind the draws stays held until its timeout)."""
        batch = self.state.book.find(request.step)
        if batch is None:
            if draw_problem(request, self.state.draw_floor, self.state.batch_shape) is not None:
                return None
            batch = self._draw(request.step, request.world_size, request.num_groups)
            if batch is None:
                return None
        elif self.state.book.conflict(request):  # held before a batch of another shape was drawn for its step
            return None  # it stays held until its timeout; asked again, it is refused (batch_mismatch)
        groups, staleness = batch.share(request.rank)
        if request.rank not in batch.delivered:
            self.state.deliver(request.step, request.rank)
            self.traffic.served(groups, staleness)
        counts = self.state.ledger.counts  # cumulative: the learner records them beside its step (learners.learner)
        return Batch(
            request.step,
            request.rank,
            groups,
            staleness,
            counts["dropped_stale"],
            counts["dropped_no_signal"],
            self.state.no_signal_reward_sum,
        )

    def _draw(self, step: int, world_size: int, num_groups: int) -> DrawnBatch | None:
        dropped = self.state.drop_stale(step)
        if dropped:
            log.warning(
                "step %d: dropped %d samples older than %d versions (total %d)",
                step,
                dropped,
                self.settings.max_staleness,
                self.state.ledger.counts["dropped_stale"],
            )
        return self.state.draw(step, world_size, num_groups)

    def _serve_held(self, now: float) -> list[Reply]:
        """Serve the held requests that can be served now (lowest step first); the others stay held."""
        if not self.state.book.held:
            return []
        replies = []
        for held in self.state.book.release_all():
            batch = self._serve(held.request)
            if batch is None:
                self.state.book.hold(held.reply_to, held.request, held.deadline, held.sender)
            else:
                replies.append((held.reply_to, batch))
        return replies

    def _version_report(self, report: VersionReport, reply_to: Any, sender: str, now: float) -> list[Reply]:
        state = self.state
        self._check(version_report_problem(report))
        self._check(version_order_problem(report, state.learner_version, state.policy_version, state.drawn_high))
        if report.resync:
            log.info(
                "learner %s announced step %d (was %d): %s",
                sender,
                report.step,
                state.learner_version,
                "resumed from an older checkpoint" if report.step < state.learner_version else "continuing",
            )
        state.report_version(report.step, report.policy_version, report.resync)
        if report.final:
            self.end.close(report.step)
        elif report.resync:
            self.end.reopen()
        for extension in self.extensions:
            extension.version_reported(report, now)
        return [(reply_to, Ok(self.state.learner_version))]

    def _stats(self, request: StatsRequest, reply_to: Any, sender: str, now: float) -> list[Reply]:
        """`counters()` plus what the learner's report of a long wait reads (`learners.stall_report`): tokens
        arrived and sampled (`Traffic.generation_counts`) and `generators_alive` (heard within heartbeat_timeout_s)."""
        live = self.counters() | self.traffic.generation_counts()
        live["generators_alive"] = len(self.state.dispenser.last_seen) - len(self.state.dispenser.dead_generators(now))
        return [(reply_to, BufferStats(live, self.state.learner_version))]

    # ------------------------------------------------------------------------------------------ housekeeping
    def tick(self, now: float) -> list[Reply]:
        """The extensions' tick, then expire overdue leases (re-issuing their prompts), answer timed-out batch
        requests, compact the journal."""
        dispenser = self.state.dispenser
        if self.extensions:  # before `forget`, which drops dead generators that hold no lease
            unresponsive = [*dispenser.dead_generators(now), *dispenser.stalled_generators(now)]
            for extension in self.extensions:
                extension.tick(now, unresponsive)
        due = dispenser.due(now)
        if due:
            whys = {lease_id: dispenser.why_due(lease_id, now) for lease_id in due}
            for lease_id in due:
                lease = dispenser.leases[lease_id]
                why = {
                    "silent": f"generator {lease.generator_id} silent for {dispenser.heartbeat_timeout_s:.0f}s",
                    "stuck": f"generator {lease.generator_id} made no progress for {dispenser.stall_timeout_s:.0f}s",
                    "deadline": f"no heartbeat listed it for {dispenser.lease_timeout_s:.0f}s",
                }[whys[lease_id]]
                log.warning("lease %d expired (%s): re-issuing %d prompts", lease_id, why, len(lease.pending))
            for kind, event in (("silent", "generators_lost"), ("stuck", "generators_stuck")):
                generators = {dispenser.leases[i].generator_id for i in due if whys[i] == kind}
                if generators:
                    self.state.ledger.event(event, len(generators))
            self.state.expire(due, now)
        dispenser.forget(now)
        replies = [
            (held.reply_to, BatchNotReady(held.request.step, len(self.state.replay)))
            for held in self.state.book.timed_out(now)
        ]
        journal = self.state.journal
        if journal is not None and journal.needs_compaction:
            self.state.compact(now)
        return replies

    def run_over(self, now: float) -> bool:
        """The learner reported its last step, no extension holds the end (a final round done or timed out), and
        every live generator has been told (`buffers.run_end`)."""
        return not self._end_held(now) and self.end.everyone_told(self.state.dispenser, now)

    def counters(self) -> dict[str, int]:
        """The ledger (samples and groups), event counts, and rejections by kind (wire-level and semantic)."""
        state = self.state
        counts = state.ledger.snapshot(state.replay.samples, len(state.replay), state.dispenser.outstanding)
        for kind, count in self.wire_rejections.items():
            counts[f"rejected_{kind}"] = counts.get(f"rejected_{kind}", 0) + int(count)
        for extension in self.extensions:
            counts.update(extension.counters())
        counts["end_pending"] = sum(extension.end_pending() for extension in self.extensions)
        return counts

    def metrics(self) -> dict[str, float]:
        """`buffer/…` values for the metrics sink (counters, sizes, staleness of served samples, bytes)."""
        values: dict[str, float] = {f"buffer/{key}": value for key, value in self.counters().items()}
        values["buffer/learner_version"] = self.state.learner_version
        leases = self.state.dispenser.leases.values()
        values["buffer/leases_active"] = sum(1 for lease in leases if lease.state == "active")
        values["buffer/epoch"] = self.state.dispenser.epoch
        values["buffer/bytes_in"], values["buffer/bytes_out"] = self.traffic.bytes_in, self.traffic.bytes_out
        values.update({f"buffer/{key}": value for key, value in self.traffic.generation_counts().items()})
        values.update(self.no_signal.metrics())  # with buffer.filter on: filtered_share, no_signal_reward_sum
        values.update(self.traffic.staleness_metrics())  # once a sample was served
        lengths = self.state.lengths  # buffers.lengths: by length bucket, and by turns in a multi-turn run
        values.update(length_metrics(self.state.ledger.counts, lengths.edges, lengths.turn_edges))
        values.update(pass_rate_metrics(self.state.ledger.counts))  # buffers.curriculum: with it off too
        return values

    @staticmethod
    def _check(problem: tuple[str, str] | None) -> None:
        if problem is not None:
            raise RequestRejected(*problem)
