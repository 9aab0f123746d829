"""The generator's side of the buffer: a reconnecting request link (`BufferLink`) and the bounded `Outbox` of groups
built but not yet acknowledged.

    link = BufferLink(config.generator.buffer_address, security, generator_id=0, reconnect_max_s=10.0)
    outbox = Outbox(capacity=config.generator.max_unsent_groups)
    outbox.add(group)
    outbox.flush(link)                  # pushes oldest first until empty or the buffer stops answering

Delivery is at-least-once: a group leaves the outbox only when the buffer answered it; "accepted" and
"duplicate" (a re-sent group it already had) both mean delivered, "rejected" (or an `ErrorReply`: the buffer found
the message malformed) is logged, counted and dropped, since sending it again would be rejected again.

Bound: the generator stops leasing while `outbox.full()`, so the outbox never holds more than
`capacity + prompts_in_flight` groups (work already in the engine is finished and kept, never dropped).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import Any

from common.sockets import Client, PeerUnavailable, SocketSecurity, backoff_delays
from common.types import ErrorReply, GroupAck, RolloutGroup
from common.wire import WireError

log = logging.getLogger("tandem.actors.outbox")


class BufferLink:
    """Requests to the buffer with reconnect back-off. `call` returns the reply, or None when the buffer did not
    answer (the link is then down until `backoff_delays(reconnect_max_s)` has passed: `ready()` says when to try
    again) or answered garbage (counted in `bad_replies`). Never raises for a dead or faulty buffer."""

    def __init__(
        self, address: str, security: SocketSecurity, generator_id: int, reconnect_max_s: float, timeout_s: float = 3.0
    ) -> None:
        self.address = address
        self.client = Client(address, security, identity=f"generator-{generator_id}", role="generator")
        self.reconnect_max_s = reconnect_max_s
        self.timeout_s = timeout_s
        self.down_since: float | None = None
        self.next_attempt = 0.0
        self.reconnects = 0  # failed attempts while the buffer was away
        self.bad_replies = 0
        self._delays = backoff_delays(reconnect_max_s)

    def ready(self, now: float) -> bool:
        return now >= self.next_attempt

    @property
    def up(self) -> bool:
        return self.down_since is None

    def call(self, message: Any) -> Any | None:
        try:
            reply, _ = self.client.request(message, timeout_s=self.timeout_s)
        except PeerUnavailable:
            self._mark_down()
            return None
        except WireError as error:
            self.bad_replies += 1
            self.client.reset()
            log.warning("buffer sent a malformed reply to %s: %s", type(message).__name__, error.reason)
            return None
        if self.down_since is not None:
            log.info("buffer %s is back after %.1fs", self.address, time.monotonic() - self.down_since)
            self.down_since = None
            self._delays = backoff_delays(self.reconnect_max_s)
        return reply

    def _mark_down(self) -> None:
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
            log.warning(
                "buffer %s does not answer; reconnecting with back-off (max %.1fs)", self.address, self.reconnect_max_s
            )
        else:
            self.reconnects += 1
        self.next_attempt = now + next(self._delays)

    def close(self) -> None:
        self.client.close()


class Outbox:
    """Groups waiting for the buffer's acknowledgement, oldest first (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.groups: deque[RolloutGroup] = deque()
        self.acks: Counter[str] = Counter()  # accepted / duplicate / rejected

    def __len__(self) -> int:
        return len(self.groups)

    def full(self) -> bool:
        return len(self.groups) >= self.capacity

    def add(self, group: RolloutGroup) -> None:
        self.groups.append(group)

    def flush(self, link: BufferLink) -> int:
        """Push groups oldest first until the outbox is empty or the buffer does not answer; returns how many
        left the outbox. Skips the attempt while the link is backing off."""
        delivered = 0
        while self.groups and link.ready(time.monotonic()):
            group = self.groups[0]
            reply = link.call(group)
            if reply is None:
                break
            self._settle(group, reply)
            self.groups.popleft()
            delivered += 1
        return delivered

    def _settle(self, group: RolloutGroup, reply: Any) -> None:
        if isinstance(reply, GroupAck) and reply.status in ("accepted", "duplicate"):
            self.acks[reply.status] += 1
            return
        reason = reply.reason if isinstance(reply, (GroupAck, ErrorReply)) else f"unexpected {type(reply).__name__}"
        self.acks["rejected"] += 1
        log.warning("buffer rejected group %s (%d samples): %s", group.group_id, group.size, reason)
