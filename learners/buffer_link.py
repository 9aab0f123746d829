"""The learner's side of the buffer protocol: pull this rank's batch for a step, report published versions.

    link = BufferLink(config.learner.buffer_address, security, rank=0, world_size=1, num_groups=4,
                      interrupted=lambda: stop_requested)
    link.report_version(policy_version, step, resync=True)   # rank 0, first: announce where this learner stands
    batch, wait_s = link.fetch_batch(step)          # blocks until the buffer has it (long-poll, retries)
    batch, wait_s = link.fetch_batch(step, on_wait=watch.waiting)   # on_wait(waited_s) after each BatchNotReady
    counters = link.stats()                         # the buffer's counters (BufferStats), or None: no answer
    link.report_version(policy_version, step)       # rank 0, after each publish
    link.report_version(policy_version, step, final=True)   # rank 0, the last step: the run is over
    pending = link.end_pending()                    # rank 0, after it: work on the final version not done (None:
                                                    # no answer)

Interruption: once `interrupted()` is true, `fetch_batch` raises `LinkInterrupted` before its next request, and
any request raises it instead of its next retry (a first attempt still goes out), so a stopping learner never
waits for a buffer that is away or refusing.

Fault handling (deliberate, counted in `counters` and logged):
- `BatchNotReady` -> ask again at once (the buffer already held the request for `hold_s`);
- `PeerUnavailable` (buffer dead or restarting) -> back off 0.1 s, 0.2 s, ... up to `reconnect_max_s` and retry,
  forever: a learner outlives a buffer restart;
- `ErrorReply` (the buffer refused the request: counted as `refused_<kind>`) -> back off the same way and retry.
  Rank 0 first re-announces its own step and version (`resync`): the learner is the authority on where it stands,
  so a buffer that lost its state, or whose view a confused peer moved, is set right, and the retry is served.
  Refusals no retry can change (`FATAL_KINDS`: this learner's key or its own config) stop it at once; any other
  stops it when they last `refusal_patience_s` without a break: `BufferRefused` with the buffer's last reason.
A batch for another step/rank, or an empty one, is a protocol bug, not a fault: RuntimeError.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from common.sockets import Client, PeerUnavailable, SocketSecurity, backoff_delays
from common.types import Batch, BatchNotReady, BatchRequest, BufferStats, ErrorReply, Ok, StatsRequest, VersionReport

log = logging.getLogger("tandem.learner.buffer")

# Refusals that say this learner cannot be served as configured: its key is not the learner's (forbidden_role), or
# its rank / world_size / num_groups / timeout are impossible for the buffer. Retrying would change nothing.
FATAL_KINDS = frozenset({"forbidden_role", "bad_rank", "bad_num_groups", "bad_timeout", "bad_version"})


class BufferRefused(RuntimeError):
    """The buffer kept refusing a request (or refused it for a reason no retry changes); `kind` is its key."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class LinkInterrupted(Exception):
    """The learner was asked to stop (`interrupted()`) while this link waited for the buffer."""


class BufferLink:
    """One rank's client of the buffer service. Not thread-safe (one loop uses it)."""

    def __init__(
        self,
        address: str,
        security: SocketSecurity,
        rank: int,
        world_size: int,
        num_groups: int,
        hold_s: float = 5.0,
        reply_margin_s: float = 5.0,
        reconnect_max_s: float = 10.0,
        refusal_patience_s: float = 120.0,
        interrupted: Callable[[], bool] = lambda: False,
    ) -> None:
        """`hold_s`: how long the buffer may hold a batch request; a reply later than hold_s + reply_margin_s
        means the buffer is unavailable. `refusal_patience_s`: how long refusals may go on before the learner stops.
        `interrupted`: true once the learner should stop (see the module docstring)."""
        self.client = Client(address, security, identity=f"learner-{rank}", role="learner")
        self.address, self.rank, self.world_size, self.num_groups = address, rank, world_size, num_groups
        self.hold_s, self.reply_margin_s, self.reconnect_max_s = hold_s, reply_margin_s, reconnect_max_s
        self.refusal_patience_s = refusal_patience_s
        self.interrupted = interrupted
        self.counters: Counter[str] = Counter()
        self.announced: tuple[int, int] | None = None  # (policy_version, step) of the last report the buffer took

    def _request(self, message: Any, what: str) -> Any:
        """Send until some reply arrives (PeerUnavailable is retried with back-off, counted, logged). An ErrorReply
        is returned (counted); one of `FATAL_KINDS` raises BufferRefused."""
        delays = backoff_delays(self.reconnect_max_s)
        while True:
            try:
                reply, _ = self.client.request(message, timeout_s=self.hold_s + self.reply_margin_s)
            except PeerUnavailable as error:
                self.counters["buffer_unavailable"] += 1
                delay = next(delays)
                log.warning("%s: buffer %s unavailable (%s); retrying in %.1fs", what, self.address, error, delay)
                self._sleep_unless_interrupted(delay, what)
                continue
            if isinstance(reply, ErrorReply):
                self.counters[f"refused_{reply.kind or 'unknown'}"] += 1
                if reply.kind in FATAL_KINDS:
                    raise BufferRefused(f"the buffer at {self.address} refused {what}: {reply.reason}", reply.kind)
            return reply

    def _after_refusal(self, refusal: ErrorReply, what: str, since: float, delays: Iterator[float]) -> None:
        """Log, give up once refusals have lasted `refusal_patience_s` (BufferRefused), else back off."""
        waited = time.monotonic() - since
        if waited >= self.refusal_patience_s:
            raise BufferRefused(
                f"the buffer at {self.address} refused {what} for {waited:.0f}s (learner.buffer refusal patience "
                f"{self.refusal_patience_s:.0f}s): {refusal.reason}",
                refusal.kind,
            )
        delay = next(delays)
        log.warning("%s refused (%s): %s; retrying in %.1fs", what, refusal.kind or "?", refusal.reason, delay)
        self._sleep_unless_interrupted(delay, what)

    def _sleep_unless_interrupted(self, delay: float, what: str) -> None:
        """Sleep `delay` seconds, raising LinkInterrupted as soon as `interrupted()` (checked every 0.1 s)."""
        deadline = time.monotonic() + delay
        while not self.interrupted():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            time.sleep(min(remaining, 0.1))
        raise LinkInterrupted(f"interrupted while waiting for {what}")

    def fetch_batch(self, step: int, on_wait: Callable[[float], None] | None = None) -> tuple[Batch, float]:
        """(this rank's `Batch` for `step`, seconds spent waiting for it); LinkInterrupted once `interrupted()`.
        `on_wait(waited_s)` is called after each BatchNotReady (every `hold_s` while the buffer has none), on this
        thread: it may use this link (`stats`), e.g. to say why nothing comes (`learners.stall_report`)."""
        start = time.perf_counter()
        request = BatchRequest(
            step=step, rank=self.rank, world_size=self.world_size, num_groups=self.num_groups, timeout_s=self.hold_s
        )
        what = f"the batch for step {step}"
        refused_since, delays = None, backoff_delays(self.reconnect_max_s)
        while True:
            if self.interrupted():
                raise LinkInterrupted(f"interrupted before {what}")
            reply = self._request(request, what)
            if isinstance(reply, ErrorReply):
                refused_since = time.monotonic() if refused_since is None else refused_since
                self._after_refusal(reply, what, refused_since, delays)
                if self.announced is not None:  # rank 0: where this learner stands, before it asks again
                    self.report_version(*self.announced, resync=True)
                continue
            refused_since, delays = None, backoff_delays(self.reconnect_max_s)
            if isinstance(reply, BatchNotReady):
                self.counters["batch_not_ready"] += 1
                if on_wait is not None:
                    on_wait(time.perf_counter() - start)
                continue
            if not isinstance(reply, Batch):
                raise RuntimeError(f"the buffer answered a batch_request with {type(reply).WIRE_NAME}")
            if reply.step != step or reply.rank != self.rank:
                raise RuntimeError(
                    f"the buffer sent the batch of step {reply.step} rank {reply.rank} for step {step} rank {self.rank}"
                )
            if not reply.groups:
                raise RuntimeError(f"the buffer sent an empty batch for step {step}")
            return reply, time.perf_counter() - start

    def report_version(self, policy_version: int, step: int, resync: bool = False, final: bool = False) -> int:
        """Tell the buffer that `policy_version` is published at `step`; returns the buffer's view of the learner
        version. `resync`: announce it (at the start, after a resume or a refusal; see `common.types.VersionReport`).
        `final`: this is the learner's last step (the buffer ends the run). A refused plain report is sent again as
        an announcement (this learner knows where it stands)."""
        message = VersionReport(policy_version=policy_version, step=step, resync=resync, final=final)
        what = f"the version report (step {step}, policy_version {policy_version})"
        refused_since, delays = None, backoff_delays(self.reconnect_max_s)
        while True:
            reply = self._request(message, what)
            if not isinstance(reply, ErrorReply):
                break
            refused_since = time.monotonic() if refused_since is None else refused_since
            self._after_refusal(reply, what, refused_since, delays)
            message = dataclasses.replace(message, resync=True)
        if not isinstance(reply, Ok):
            raise RuntimeError(f"the buffer answered a version_report with {type(reply).WIRE_NAME}")
        self.announced = (policy_version, step)
        return reply.learner_version

    def end_pending(self, timeout_s: float = 2.0) -> int | None:
        """The buffer's `end_pending` counter (pieces of work on the final version the run's end still waits for,
        such as eval sets of the final round: 0 once done or timed out, and in a buffer with no such work), from
        one StatsRequest; None when the buffer does not answer within `timeout_s` or refuses (counted
        `stats_unanswered`): it exited, or is away. Never retries."""
        counters = self.stats(timeout_s)
        return None if counters is None else int(counters.get("end_pending", 0))

    def stats(self, timeout_s: float = 2.0) -> dict[str, int] | None:
        """The buffer's counters (`BufferStats`: the ledger, rejections by kind, tokens arrived and sampled,
        generators alive) from one StatsRequest; None when it does not answer within `timeout_s` or refuses
        (counted `stats_unanswered`). Never retries."""
        try:
            reply, _ = self.client.request(StatsRequest(), timeout_s=timeout_s)
        except PeerUnavailable:
            reply = None
        if not isinstance(reply, BufferStats):
            self.counters["stats_unanswered"] += 1
            return None
        return dict(reply.counters)

    def close(self) -> None:
        self.client.close()
