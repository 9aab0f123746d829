"""The learner's buffer client over real sockets: it waits out a buffer that is down or not ready, takes only
the batch it asked for, and reports versions."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from buffers.core import RequestRejected
from common.sockets import Server, SocketSecurity
from common.types import LeaseRequest, VersionReport
from launch.testing import ServerThread, free_port
from learners.buffer_link import BufferLink, BufferRefused, LinkInterrupted
from tests.buffers.fakes import GROUP, make_core, make_group
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


def test_an_interrupted_learner_stops_waiting_for_a_buffer_that_is_away() -> None:
    """Nothing listens: the fetch backs off (up to 10 s a retry) until the learner is interrupted, then raises; an
    interrupted link sends no new batch request at all."""
    stop = threading.Event()
    client = BufferLink(
        f"127.0.0.1:{free_port()}",
        SocketSecurity(),
        0,
        1,
        num_groups=2,
        hold_s=0.1,
        reply_margin_s=0.1,
        reconnect_max_s=10.0,
        interrupted=stop.is_set,
    )
    try:
        threading.Thread(target=lambda: (time.sleep(0.5), stop.set()), daemon=True).start()
        with pytest.raises(LinkInterrupted, match="while waiting for the batch for step 0"):
            client.fetch_batch(0)
        unavailable = client.counters["buffer_unavailable"]
        assert unavailable >= 1
        with pytest.raises(LinkInterrupted, match="before the batch for step 1"):
            client.fetch_batch(1)
        assert client.counters["buffer_unavailable"] == unavailable  # no request went out
    finally:
        client.close()


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


def _refusing_server(port: int, kind: str, reason: str) -> Callable[[], None]:
    """A server that refuses every request with `kind`, in a thread; returns the function that stops it."""
    server, stop = Server("127.0.0.1", port, SocketSecurity(), name="refusing-buffer"), threading.Event()

    def refuse() -> None:
        try:
            while not stop.is_set():
                request = server.poll(timeout_ms=50)
                if request is not None:
                    server.reject(request, reason, kind)
        finally:
            server.close()

    thread = threading.Thread(target=refuse, daemon=True)
    thread.start()
    return lambda: (stop.set(), thread.join(timeout=10))


def test_a_refusal_no_retry_can_change_stops_the_learner_naming_the_buffers_reason() -> None:
    port = free_port()
    stop = _refusing_server(port, "forbidden_role", "a peer of role 'generator' may not send 'batch_request'")
    client = link(port)
    try:
        with pytest.raises(BufferRefused, match=r"refused the batch for step 9: a peer of role 'generator'"):
            client.fetch_batch(9)
        assert client.counters["refused_forbidden_role"] == 1
    finally:
        stop()
        client.close()


def test_refusals_are_retried_until_they_outlast_the_patience_then_stop_with_the_reason() -> None:
    port = free_port()
    stop = _refusing_server(port, "old_step", "step 9 was drawn already")
    client = link(port)
    client.refusal_patience_s = 1.0
    try:
        started = time.monotonic()
        with pytest.raises(BufferRefused, match=r"refused the batch for step 9 for 1s .*: step 9 was drawn already"):
            client.fetch_batch(9)
        assert time.monotonic() - started >= 1.0 and client.counters["refused_old_step"] >= 3
    finally:
        stop()
        client.close()


class CoreServer(ServerThread):
    """A buffer core behind a real socket, checking roles as the service does; the test feeds it groups."""

    name = "core-buffer"

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.core = make_core(groups_per_step=2, max_staleness=1)
        self.start()

    def answer(self, server: Server, request: Any) -> list[tuple[Any, Any, list[Any]]]:
        try:
            replies = self.core.handle(request.message, request, request.sender, time.time(), role=request.role)
        except RequestRejected as refusal:
            server.reject(request, refusal.reason, refusal.kind)
            return []
        return [(reply_to, reply, []) for reply_to, reply in replies]

    def feed(self, version: int) -> None:
        """Lease the prompts of one batch at `version` and push their groups."""
        with self.lock:
            ((_, grant),) = self.core.handle(LeaseRequest(0, 2, version), None, "generator", time.time())
            for prompt in grant.prompts:
                self.core.handle(make_group(grant.lease_id, prompt, 0, GROUP, version), None, "generator", time.time())


def test_a_buffer_whose_view_was_moved_back_is_set_right_by_re_announcing() -> None:
    """Another learner-role peer rewound the buffer to step 0: the next batch request is refused (bad_step), and
    rank 0 re-announces its own step (resync) and is served; nothing made it exit."""
    port = free_port()
    buffer = CoreServer(port)
    client = link(port)
    try:
        client.report_version(0, 0, resync=True)
        for step in range(4):
            buffer.feed(step)
            if step < 3:
                assert client.fetch_batch(step)[0].step == step
                client.report_version(step + 1, step + 1)
        with buffer.lock:
            buffer.core.handle(VersionReport(0, 0, resync=True), None, "intruder", time.time(), role="learner")
        batch, _ = client.fetch_batch(3)
        assert batch.step == 3 and client.counters["refused_bad_step"] == 1
        assert buffer.core.state.learner_version == 3 and client.announced == (3, 3)
    finally:
        client.close()
        buffer.stop()
