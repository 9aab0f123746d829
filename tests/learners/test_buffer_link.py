"""The learner's buffer client over real sockets: it waits out a buffer that is down or not ready, takes only
the batch it asked for, and reports versions."""

from __future__ import annotations

import threading
import time

import pytest

from common.sockets import Server, SocketSecurity
from common.types import ErrorReply, VersionReport
from launch.testing import free_port
from learners.buffer_link import BufferLink
from tests.learners.learner_fakes import SyntheticBuffer


def link(port: int, rank: int = 0, world_size: int = 1) -> BufferLink:
    return BufferLink(
        f"127.0.0.1:{port}",
        SocketSecurity(),
        rank,
        world_size,
        num_groups=2,
        hold_s=0.1,
        reply_margin_s=0.3,
        reconnect_max_s=0.2,
    )


def test_fetch_outlives_a_buffer_that_starts_late_and_is_not_ready_at_first() -> None:
    port = free_port()
    client = link(port, rank=1, world_size=2)
    result: dict[str, object] = {}
    # step 1: a buffer that has heard no VersionReport yet serves steps 0 and 1 (sync_every = 1)
    thread = threading.Thread(target=lambda: result.update(zip(("batch", "wait"), client.fetch_batch(1))))
    thread.start()
    try:
        thread.join(timeout=1.5)  # no buffer for 1.5 s at least: requests time out and are retried with back-off
        assert thread.is_alive()
        # the state the buffer's start needs, two timed-out requests (0.4 s each + back-off): waited for, not
        # assumed of 1.5 s on a loaded machine
        deadline = time.monotonic() + 30
        while client.counters["buffer_unavailable"] < 2:
            assert time.monotonic() < deadline and thread.is_alive(), client.counters
            time.sleep(0.05)
        buffer = SyntheticBuffer(port, groups_per_step=2, group_size=4, gate=4)
        try:
            thread.join(timeout=20)
        finally:
            buffer.close()
    finally:
        thread.join(timeout=20)
        client.close()
    batch = result["batch"]
    assert (batch.step, batch.rank, len(batch.groups)) == (1, 1, 1)
    assert result["wait"] >= 1.0


def test_not_ready_is_asked_again_and_versions_are_reported() -> None:
    port = free_port()
    buffer = SyntheticBuffer(port, groups_per_step=2, group_size=4, gate=0)
    client = link(port)
    try:
        timer = threading.Timer(0.5, buffer.set_gate, args=(None,))
        timer.start()
        batch, wait_s = client.fetch_batch(0)
        assert batch.step == 0 and len(batch.groups) == 2
        assert client.counters["batch_not_ready"] >= 2 and wait_s >= 0.4
        assert client.report_version(1, 1) == 1
        assert buffer.reports == [VersionReport(policy_version=1, step=1)]
    finally:
        client.close()
        buffer.close()


def test_a_refusal_is_an_error_that_names_the_buffers_reason() -> None:
    port = free_port()
    server = Server("127.0.0.1", port, SocketSecurity(), name="refusing-buffer")

    def refuse() -> None:
        request = server.poll(timeout_ms=10_000)
        server.reply(request, ErrorReply(reason="step 9 is not in [0, 2]"))

    thread = threading.Thread(target=refuse)
    thread.start()
    client = link(port)
    try:
        with pytest.raises(RuntimeError, match=r"refused batch for step 9: step 9 is not in \[0, 2\]"):
            client.fetch_batch(9)
    finally:
        thread.join(timeout=10)
        client.close()
        server.close()
