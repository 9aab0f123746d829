"""The outbox and the buffer link (actors/outbox.py) against a fake buffer on a real loopback socket."""

from __future__ import annotations

import time

import numpy as np
import pytest

from actors.engine.api import FinishedSample
from actors.groups import PendingGroups, build_group
from actors.outbox import BufferLink, Outbox
from actors.rewards.functions import Score
from common.sockets import SocketSecurity
from common.types import LeaseGrant, LeaseRequest, RolloutGroup
from launch.testing import FakeBuffer, arithmetic_items, free_port, run_config


def _groups(grant: LeaseGrant) -> list[RolloutGroup]:
    """One single-sample group per prompt of `grant` (the buffer's `algo.group_size` is 1 here)."""
    book, groups = PendingGroups(group_size=1), []
    for prompt in grant.prompts:
        pending = book.start(grant.lease_id, prompt, [1, 2])
        tokens = np.ones(3, np.int32)
        book.record(
            FinishedSample(
                f"{grant.lease_id}:{prompt.prompt_id}:0", tokens, -np.ones(3, np.float32), tokens * 0, "stop", 0
            )
        )
        groups.append(build_group(pending, [Score(1.0, {"r": 1.0})], generator_id=0))
    return groups


def test_groups_are_kept_while_the_buffer_is_away_and_delivered_when_it_returns(tmp_path):
    config = run_config(tmp_path, "outbox", algo={"group_size": 1, "estimator": "reinforce_pp"})
    buffer = FakeBuffer(config, arithmetic_items(5), lease_size=5).start()
    # timeout_s: how long an answer may take on a loaded machine before the buffer counts as away (1 s, not 0.3 s)
    link = BufferLink(config.generator.buffer_address, SocketSecurity(), 0, reconnect_max_s=0.2, timeout_s=1.0)
    outbox = Outbox(capacity=3)
    try:
        groups = _groups(link.call(LeaseRequest(0, 5, 0)))
        outbox.add(groups[0])
        assert outbox.flush(link) == 1 and len(outbox) == 0
        outbox.add(groups[0])  # re-sent: the buffer already has it
        assert outbox.flush(link) == 1 and outbox.acks == {"accepted": 1, "duplicate": 1}

        buffer.stop()
        for group in groups[1:]:
            outbox.add(group)
        assert outbox.flush(link) == 0 and len(outbox) == 4 and outbox.full()
        # backing off, no busy retry: the next attempt is the first delay (0.1 s) after the moment it went down
        # (read from the link, not from a clock that a paused test may have moved past it)
        assert not link.up and link.next_attempt - link.down_since == pytest.approx(0.1)

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


def test_rejected_groups_are_counted_and_dropped(tmp_path):
    config = run_config(tmp_path, "outbox", algo={"group_size": 2})  # 2 samples a group, 1 came
    buffer = FakeBuffer(config, arithmetic_items(2)).start()
    link = BufferLink(config.generator.buffer_address, SocketSecurity(), 0, reconnect_max_s=0.2, timeout_s=2.0)
    outbox = Outbox(capacity=8)
    try:
        for group in _groups(link.call(LeaseRequest(0, 2, 0))):
            outbox.add(group)
        assert outbox.flush(link) == 2 and len(outbox) == 0 and outbox.acks["rejected"] == 2
        assert buffer.counters()["rejected_wrong_group_size"] == 2
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
