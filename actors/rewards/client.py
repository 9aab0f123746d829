"""The generator's side of the reward service: whole groups sent, scores collected, never blocking the loop.

    client = RewardClient(config.reward.address, security, timeout_s=config.reward.timeout_s, name="generator-0")
    client.submit(key, prompt_messages, completions, now)          # queued; sent at once if the service is up
    for result in client.collect(now):                             # each pass of the generator's loop
        result.key, result.scores, result.error                    # scores None: fall back (error says why)

Each request carries its own id (echoed in the reply) and lives until its reply or `timeout_s` after submit,
whichever comes first. Faults, each deliberately survived, counted and logged (never raised):
  - the service is down or restarting: the socket queues nothing while no connection is up (ZMQ_IMMEDIATE), so
    the request waits here and is sent once ZeroMQ has reconnected; past its deadline it falls back (`fallbacks`);
  - the service is slow: past the deadline the request falls back; its reply, if it comes, is dropped
    (`late_replies`), as is any reply to an id not waiting (a restarted service answering an old request);
  - the service answers an error (the group could not be scored, or the request was rejected): falls back;
  - a malformed reply: dropped (`bad_replies`); its request falls back at its deadline.
`fallbacks` counts groups. One thread.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Hashable
from dataclasses import dataclass

import zmq

from common.sockets import Client, SocketSecurity
from common.types import ErrorReply, RewardReply, RewardRequest
from common.wire import WireError

log = logging.getLogger("tandem.actors.reward_client")
UNREACHABLE_WARN_S = 1.0


@dataclass(frozen=True)
class RewardResult:
    key: Hashable  # what the caller submitted the group under
    scores: list[float] | None  # one per completion, in order; None: the group falls back
    error: str = ""  # why it fell back


@dataclass
class _Waiting:
    key: Hashable
    request: RewardRequest
    deadline: float  # time.monotonic()
    envelope: bytes | None = None  # the socket's request id once sent; None while unsent


class RewardClient:
    """See the module docstring."""

    def __init__(self, address: str, security: SocketSecurity, timeout_s: float, name: str) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.client = Client(address, security, identity=name, role="generator", immediate=True)
        self._ids = itertools.count(1)
        self.waiting: dict[int, _Waiting] = {}  # request_id -> the group waiting for its scores
        self._by_envelope: dict[bytes, int] = {}  # envelope request id -> request_id (error replies carry only it)
        self.fallbacks = 0  # groups given the fallback
        self.late_replies = 0  # replies to requests no longer waiting
        self.bad_replies = 0  # replies that did not decode
        self.scored = 0  # groups scored by the service
        self._down_since: float | None = None  # first failed send of the current outage
        self._warned = False  # its warning is logged (one per outage, not one per group)

    def submit(self, key: Hashable, prompt: list[dict[str, str]], completions: list[str], now: float) -> None:
        request_id = next(self._ids)
        request = RewardRequest(request_id=request_id, prompt=prompt, completions=completions)
        self.waiting[request_id] = _Waiting(key, request, now + self.timeout_s)
        self._send_unsent(now)

    def in_flight(self) -> int:
        return len(self.waiting)

    def collect(self, now: float, wait_s: float = 0.0) -> list[RewardResult]:
        """The groups whose scores came (or who fell back) since the last call; waits up to `wait_s` for a reply."""
        self._send_unsent(now)
        results = []
        wait = wait_s if self.waiting else 0.0
        while self.client.socket is not None and (reply := self._receive(wait)) is not None:
            wait = 0.0  # then whatever else has arrived; late replies are read (and counted) too
            result = self._match(*reply)
            if result is not None:
                results.append(result)
        return results + self._expire(now)

    def _send_unsent(self, now: float) -> None:
        for request_id, item in self.waiting.items():
            if item.envelope is not None:
                continue
            try:
                item.envelope = self.client.send(item.request)
            except zmq.Again:  # no live connection: ZeroMQ keeps reconnecting; the request waits here
                self._note_unreachable(now)
                return
            self._by_envelope[item.envelope] = request_id
            if self._warned:
                log.info("reward service %s reachable again after %.1fs", self.address, now - self._down_since)
            self._down_since, self._warned = None, False

    def _note_unreachable(self, now: float) -> None:
        """One warning per outage, once it has lasted UNREACHABLE_WARN_S (a fresh socket is not connected yet)."""
        if self._down_since is None:
            self._down_since = now
        elif not self._warned and now - self._down_since >= UNREACHABLE_WARN_S:
            self._warned = True
            log.warning("reward service %s unreachable: groups wait up to %.0fs", self.address, self.timeout_s)

    def _receive(self, wait_s: float) -> tuple[bytes, object] | None:
        try:
            return self.client.receive(wait_s)
        except WireError as error:
            self.bad_replies += 1
            log.warning("malformed reply from the reward service dropped (%d so far): %s", self.bad_replies, error)
            return None

    def _match(self, envelope: bytes, message: object) -> RewardResult | None:
        request_id = self._by_envelope.pop(envelope, None)
        item = self.waiting.pop(request_id, None) if request_id is not None else None
        if item is None:
            self.late_replies += 1
            log.info("a reply to a request no longer waiting dropped (%d so far)", self.late_replies)
            return None
        if isinstance(message, RewardReply) and message.request_id == request_id and not message.error:
            if len(message.scores) == len(item.request.completions):
                self.scored += 1
                return RewardResult(item.key, list(message.scores))
            why = f"{len(message.scores)} scores for {len(item.request.completions)} completions"
        elif isinstance(message, RewardReply):
            why = message.error or f"reply to request {message.request_id}, expected {request_id}"
        elif isinstance(message, ErrorReply):
            why = f"rejected ({message.kind}): {message.reason}"
        else:
            why = f"unexpected reply {type(message).__name__}"
        return self._fall_back(item, why)

    def _expire(self, now: float) -> list[RewardResult]:
        expired = [request_id for request_id, item in self.waiting.items() if now >= item.deadline]
        results = []
        for request_id in expired:
            item = self.waiting.pop(request_id)
            if item.envelope is not None:
                self._by_envelope.pop(item.envelope, None)  # its reply, if it ever comes, counts as late
                why = f"no reply within reward.timeout_s = {self.timeout_s:.0f}s"
            else:
                why = f"reward service {self.address} unreachable for reward.timeout_s = {self.timeout_s:.0f}s"
            results.append(self._fall_back(item, why))
        return results

    def _fall_back(self, item: _Waiting, why: str) -> RewardResult:
        self.fallbacks += 1
        log.warning("group %s: reward_model falls back (%d groups so far): %s", item.key, self.fallbacks, why)
        return RewardResult(item.key, None, why)

    def close(self) -> None:
        self.client.close()
