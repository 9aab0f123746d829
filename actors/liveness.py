"""The generator's heartbeat, on a thread of its own: liveness that does not depend on speed.

    pulse = Pulse(BufferLink(address, security, generator_id, reconnect_max_s), generator_id)
    pulse.start()
    ...                                    # the loop, after each engine step that ran a request:
    pulse.note(policy_version, lease_ids, eval_lease_ids, worked=1, tokens=tokens_sampled)
    if pulse.run_over is not None: ...     # the buffer answered a heartbeat RunOver
    pulse.stop()

One engine step of a slow engine (an emulated-bf16 CPU, a 32k-token reasoning sample's prefill) or one blocking
environment call can outlast `buffer.heartbeat_timeout_s`. Heartbeats sent from the loop between steps then stop,
and the buffer takes a live generator for dead and re-issues its leases: its finished work comes back "unknown" and
is thrown away. So the heartbeat runs here, every `HEARTBEAT_S` whatever the loop is doing, over its own socket
(ZeroMQ sockets are not thread-safe: the loop's `BufferLink` stays the loop's).

What it reports is what the loop last noted: the policy version, the training leases and the eval lease it holds,
a progress counter (engine steps that ran a request, samples finished, environment calls answered) and the completion tokens sampled so far
(the buffer's generation rate, for the learner's report of a long wait). The buffer renews the listed leases
while the counter moves, and takes a generator whose counter stands still for `buffer.stall_timeout_s` as stuck
(`buffers.leases`): alive is not the same as making progress. A process that dies takes this thread with it, so a
dead generator is still found within `heartbeat_timeout_s`.

Thread safety: `note` replaces whole tuples and ints (one writer, the loop); the thread reads them as they are.
"""

from __future__ import annotations

import logging
import threading
import time

from actors.outbox import BufferLink
from common.types import Heartbeat, RunOver

HEARTBEAT_S = 2.0  # at most; the generator uses min(HEARTBEAT_S, buffer.heartbeat_timeout_s / 4)

log = logging.getLogger("tandem.actors.liveness")


class Pulse:
    """The heartbeat thread of one generator (see the module docstring)."""

    def __init__(self, link: BufferLink, generator_id: int, period_s: float = HEARTBEAT_S) -> None:
        self.link = link
        self.generator_id = generator_id
        self.period_s = period_s
        self.policy_version = 0
        self.lease_ids: tuple[int, ...] = ()
        self.eval_lease_ids: tuple[int, ...] = ()
        self.progress = 0
        self.tokens = 0  # cumulative completion tokens sampled, as the loop last noted
        self.sent = 0  # heartbeats answered
        self.run_over: RunOver | None = None  # the buffer's RunOver, once a heartbeat got one
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{generator_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def note(
        self,
        policy_version: int,
        lease_ids: list[int],
        eval_lease_ids: list[int] | tuple[int, ...],
        worked: int = 0,
        tokens: int | None = None,
    ) -> None:
        """The loop's state for the next heartbeat; `worked`: units of progress since the last note; `tokens`: the
        cumulative completion tokens sampled (None: unchanged)."""
        self.policy_version = policy_version
        if tokens is not None:
            self.tokens = tokens
        self.lease_ids = tuple(lease_ids)
        self.eval_lease_ids = tuple(eval_lease_ids)
        self.progress += worked

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self._send()
            except Exception:  # a heartbeat must never end the thread: a dead thread is a dead generator
                log.exception("heartbeat failed; trying again in %.1fs", self.period_s)
            self._stop.wait(self.period_s)

    def _send(self) -> None:
        if not self.link.ready(time.monotonic()):
            return
        heartbeat = Heartbeat(
            self.generator_id,
            self.policy_version,
            list(self.lease_ids),
            progress=self.progress,
            tokens=self.tokens,
            eval_lease_ids=list(self.eval_lease_ids),
        )
        reply = self.link.call(heartbeat)
        if reply is not None:
            self.sent += 1
        if isinstance(reply, RunOver) and self.run_over is None:
            self.run_over = reply

    def stop(self) -> None:
        """Stop the thread and close its socket (waits at most one request's timeout)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.link.timeout_s + self.period_s)
        self.link.close()
