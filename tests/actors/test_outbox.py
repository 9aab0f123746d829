"""The outbox and the buffer link (actors/outbox.py) against a fake buffer on a real loopback socket."""

from __future__ import annotations

import time

import numpy as np

from actors.engine_api import FinishedSample
from actors.groups import LeaseBook, build_group
from actors.outbox import BufferLink, Outbox
from actors.rewards import Score
from common.sockets import SocketSecurity
from common.types import GroupAck, LeaseGrant, LeaseRequest, RolloutGroup
from tests.actors.fakes import FakeBuffer, arithmetic_items
from tests.conftest import free_port


def _groups(count: int) -> list[RolloutGroup]:
    book, groups = LeaseBook(group_size=1), []
    for prompt in arithmetic_items(count):
        book.add_grant(LeaseGrant(lease_id=1, deadline=0.0, prompts=[prompt]))
        pending = book.start(1, prompt, [1, 2])
        tokens = np.ones(3, np.int32)
        book.record(FinishedSample(f"1:{prompt.prompt_id}:0", tokens, -np.ones(3, np.float32), tokens * 0, "stop", 0))
        groups.append(build_group(pending, [Score(1.0, {"r": 1.0})], generator_id=0))
    return groups


def test_groups_are_kept_while_the_buffer_is_away_and_delivered_when_it_returns():
    port = free_port()
    buffer = FakeBuffer(port, prompts=[]).start()
    link = BufferLink(f"127.0.0.1:{port}", SocketSecurity(), generator_id=0, reconnect_max_s=0.2, timeout_s=0.3)
    outbox = Outbox(capacity=3)
    groups = _groups(5)
    try:
        outbox.add(groups[0])
        assert outbox.flush(link) == 1 and len(outbox) == 0
        outbox.add(groups[0])  # re-sent: the buffer already has it
        assert outbox.flush(link) == 1 and outbox.acks == {"accepted": 1, "duplicate": 1}

        buffer.stop()
        for group in groups[1:]:
            outbox.add(group)
        assert outbox.flush(link) == 0 and len(outbox) == 4 and outbox.full()
        assert not link.up and not link.ready(time.monotonic())  # backing off, no busy retry

        buffer.start()
        deadline = time.monotonic() + 10
        while len(outbox) and time.monotonic() < deadline:
            outbox.flush(link)
            time.sleep(0.05)
        assert len(outbox) == 0 and link.up
        assert sorted(buffer.groups) == sorted(g.group_id for g in groups)  # nothing lost
    finally:
        buffer.stop()
        link.close()


class _RejectingBuffer(FakeBuffer):
    def handle(self, message):
        if isinstance(message, RolloutGroup):
            return GroupAck(message.lease_id, message.prompt_id, "rejected", "malformed on purpose"), []
        return super().handle(message)


def test_rejected_groups_are_counted_and_dropped():
    port = free_port()
    buffer = _RejectingBuffer(port, prompts=[]).start()
    link = BufferLink(f"127.0.0.1:{port}", SocketSecurity(), generator_id=0, reconnect_max_s=0.2, timeout_s=2.0)
    outbox = Outbox(capacity=8)
    try:
        for group in _groups(2):
            outbox.add(group)
        assert outbox.flush(link) == 2 and len(outbox) == 0 and outbox.acks["rejected"] == 2
    finally:
        buffer.stop()
        link.close()


def test_link_returns_none_instead_of_raising_when_nobody_listens():
    link = BufferLink(f"127.0.0.1:{free_port()}", SocketSecurity(), generator_id=0, reconnect_max_s=1.0, timeout_s=0.1)
    try:
        assert link.call(LeaseRequest(0, 1, 0)) is None and not link.up
        first_wait = link.next_attempt - time.monotonic()
        time.sleep(max(0.0, first_wait))
        assert link.call(LeaseRequest(0, 1, 0)) is None and link.reconnects == 1
        assert link.next_attempt - time.monotonic() > first_wait  # the back-off grows
    finally:
        link.close()
