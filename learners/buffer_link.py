"""The learner's side of the buffer protocol: pull this rank's batch for a step, report published versions.

    link = BufferLink(config.learner.buffer_address, security, rank=0, world_size=1, num_groups=4)
    batch, wait_s = link.fetch_batch(step)          # blocks until the buffer has it (long-poll, retries)
    link.report_version(policy_version, step)       # rank 0, after each publish

Fault handling (deliberate, counted in `counters` and logged): `BatchNotReady` -> ask again at once (the buffer
already held the request for `hold_s`); `PeerUnavailable` (buffer dead or restarting) -> back off 0.1 s, 0.2 s,
... up to `reconnect_max_s` and retry, forever: a learner outlives a buffer restart. An `ErrorReply` or a batch
for another step/rank is a protocol bug, not a fault: it raises RuntimeError with the buffer's reason.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from common.sockets import Client, PeerUnavailable, SocketSecurity, backoff_delays
from common.types import Batch, BatchNotReady, BatchRequest, ErrorReply, Ok, VersionReport

log = logging.getLogger("tandem.learner.buffer")


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
    ) -> None:
        """`hold_s`: how long the buffer may hold a batch request; a reply later than hold_s + reply_margin_s
        means the buffer is unavailable."""
        self.client = Client(address, security, identity=f"learner-{rank}")
        self.address, self.rank, self.world_size, self.num_groups = address, rank, world_size, num_groups
        self.hold_s, self.reply_margin_s, self.reconnect_max_s = hold_s, reply_margin_s, reconnect_max_s
        self.counters: Counter[str] = Counter()

    def _request(self, message: Any, what: str) -> Any:
        """Send until some reply arrives; PeerUnavailable is retried with back-off (counted, logged)."""
        delays = backoff_delays(self.reconnect_max_s)
        while True:
            try:
                reply, _ = self.client.request(message, timeout_s=self.hold_s + self.reply_margin_s)
            except PeerUnavailable as error:
                self.counters["buffer_unavailable"] += 1
                delay = next(delays)
                log.warning("%s: buffer %s unavailable (%s); retrying in %.1fs", what, self.address, error, delay)
                time.sleep(delay)
                continue
            if isinstance(reply, ErrorReply):
                raise RuntimeError(f"the buffer at {self.address} refused {what}: {reply.reason}")
            return reply

    def fetch_batch(self, step: int) -> tuple[Batch, float]:
        """(this rank's `Batch` for `step`, seconds spent waiting for it)."""
        start = time.perf_counter()
        request = BatchRequest(
            step=step, rank=self.rank, world_size=self.world_size, num_groups=self.num_groups, timeout_s=self.hold_s
        )
        while True:
            reply = self._request(request, f"batch for step {step}")
            if isinstance(reply, BatchNotReady):
                self.counters["batch_not_ready"] += 1
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

    def report_version(self, policy_version: int, step: int) -> int:
        """Tell the buffer that `policy_version` is published; returns the buffer's view of the learner version."""
        reply = self._request(VersionReport(policy_version=policy_version, step=step), "version report")
        if not isinstance(reply, Ok):
            raise RuntimeError(f"the buffer answered a version_report with {type(reply).WIRE_NAME}")
        return reply.learner_version

    def close(self) -> None:
        self.client.close()
