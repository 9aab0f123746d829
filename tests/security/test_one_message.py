"""No service dies of one message (issue 37, items 1, 2 and 8).

The message that killed them: a list where an integer belongs (`{"generator_id": []}`) made the decoder raise
StopIteration, which every `Server.poll` runs before any role check. Sent here, raw and role-less, to the real buffer
process (journal on), the reward service, the weights publisher's thread and a generator's relay thread: each must
answer it with an ErrorReply and then still answer a legitimate request. A fault inside a handler is a counted,
answered rejection (`common.serving.answer_safely`), a serving thread that dies is restarted, and a journal never
replays the event that broke the buffer.
"""

from __future__ import annotations

import struct
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from actors.rewards.service import RewardService
from actors.weights.relay import open_relay_server
from buffers.journal import Journal
from buffers.state import BufferState
from common import serving
from common.sockets import Client, Server, SocketSecurity, free_port
from common.types import (
    PROTOCOL_VERSION,
    BufferStats,
    ErrorReply,
    LeaseGrant,
    LeaseRequest,
    RewardReply,
    RewardRequest,
    StatsRequest,
)
from common.weight_messages import ChunkRequest, ChunkUnavailable, WeightsHeader, WeightsRequest
from common.wire import decode
from launch.testing import RoleUnderTest, run_config, wait_until
from learners.publisher import ZmqWeightsPublisher
from tests.buffers.fakes import fake_prompts, make_group, make_settings

PLAIN = SocketSecurity()
POISON_FIELDS = [{"generator_id": []}, {"generator_id": [1, 2, 3]}]


def poison(name: str, fields: dict[str, Any]) -> list[bytes]:
    """A header whose one field is a list where an integer belongs (the other fields at valid values)."""
    base = {
        "lease_request": {"generator_id": 0, "max_prompts": 1, "policy_version": 0},
        "weights_request": {"generator_id": 0, "have_version": -1},
        "chunk_request": {"generator_id": 0, "version": 0, "first": 0, "max_chunks": 1},
        "reward_request": {"request_id": 0, "prompt": [{"role": "user", "content": "hi"}], "completions": ["a"]},
    }[name]
    fields = {"request_id": []} if name == "reward_request" else fields
    return [msgpack.packb({"p": PROTOCOL_VERSION, "t": name, "a": 0, "f": {**base, **fields}})]


def send_raw(address: str, frames: list[bytes], role: str | None = None, timeout_s: float = 10.0) -> Any:
    """Send raw frames as a DEALER (declaring `role`, or none) and decode the reply."""
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if role is not None:
        sock.setsockopt(zmq.METADATA, f"X-Tandem-Role:{role}".encode())
    sock.connect(f"tcp://{address}")
    try:
        sock.send_multipart([b"", struct.pack("<Q", 1), *frames])
        assert sock.poll(int(timeout_s * 1000)), "no reply to the raw message"
        return decode(sock.recv_multipart()[2:])[0]
    finally:
        sock.close(linger=0)


def refused(reply: Any) -> bool:
    return isinstance(reply, ErrorReply) and reply.kind == "invalid_fields"


# ------------------------------------------------------------------------------------------------ the buffer
@pytest.mark.integration
def test_the_buffer_process_survives_the_message_and_a_restart_does_not_replay_it(tmp_path: Path) -> None:
    config = run_config(tmp_path / "runs", "poison", buffer={"persist": True}, env={"num_prompts": 8})
    address = config.generator.buffer_address
    buffer = RoleUnderTest(config, "buffer")
    with buffer:  # started; SIGKILLed on the way out, whatever happened
        client = Client(address, PLAIN, "generator", role="generator")

        def stats() -> BufferStats | None:
            try:
                return client.request(StatsRequest(), timeout_s=1.0)[0]
            except Exception:  # noqa: BLE001 - not up yet
                return None

        buffer.wait_until(stats, 60, "the buffer's first answer")
        for fields in POISON_FIELDS:
            assert refused(send_raw(address, poison("lease_request", fields)))
            assert refused(send_raw(address, poison("lease_request", fields), role="generator"))
        grant = client.request(LeaseRequest(generator_id=0, max_prompts=1, policy_version=0), timeout_s=10)[0]
        assert isinstance(grant, LeaseGrant), grant
        assert stats().counters["rejected_invalid_fields"] == 4
        assert buffer.poll() is None
        assert buffer.stop(grace_s=20) == 0
        buffer.start()  # from its journal: the lease is restored, the poison was never journaled
        restored = buffer.wait_until(stats, 60, "the restarted buffer's stats")
        assert restored.counters.get("journal_skipped", 0) == 0
        assert restored.counters["leases_issued"] == 1
        assert refused(send_raw(address, poison("lease_request", POISON_FIELDS[0])))
        again = client.request(LeaseRequest(generator_id=0, max_prompts=1, policy_version=0), timeout_s=10)[0]
        assert isinstance(again, LeaseGrant) and again.lease_id != grant.lease_id
        client.close()


# ------------------------------------------------------------------------------------------------ the reward service
class _LengthScorer:
    batch_size = 8

    def score_chats(self, chats: list) -> list[float]:
        return [float(len(chat[-1]["content"])) for chat in chats]


def test_the_reward_service_survives_the_message_and_scores_the_next_request() -> None:
    port = free_port()
    service = RewardService(_LengthScorer(), Server("127.0.0.1", port, PLAIN, name="reward"))
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [service.serve_batch(0.05) for _ in iter(stop.is_set, True)])
    thread.start()
    try:
        assert refused(send_raw(f"127.0.0.1:{port}", poison("reward_request", {}), role="generator"))
        client = Client(f"127.0.0.1:{port}", PLAIN, "generator", role="generator")
        request = RewardRequest(request_id=7, prompt=[{"role": "user", "content": "q"}], completions=["abc"])
        reply = client.request(request, timeout_s=10)[0]
        client.close()
        assert isinstance(reply, RewardReply) and reply.scores == [3.0]
        assert thread.is_alive()
    finally:
        stop.set()
        thread.join(timeout=10)
        service.server.close()
    service.counters.rejected = dict(service.server.rejected)
    assert service.counters.values()["reward_service/rejected_invalid_fields"] == 1


# ------------------------------------------------------------------------------------------------ weights threads
LAYOUT = [("w", "float32", [16])]


def test_the_weights_publisher_thread_survives_the_message_and_serves_weights() -> None:
    port = free_port()
    publisher = ZmqWeightsPublisher("127.0.0.1", port, PLAIN, bucket_bytes=1 << 16)
    try:
        publisher.publish(1, LAYOUT, [("w", np.ones(16, np.float32))])
        for fields in POISON_FIELDS:
            assert refused(send_raw(f"127.0.0.1:{port}", poison("weights_request", fields), role="generator"))
        client = Client(f"127.0.0.1:{port}", PLAIN, "generator", role="generator")
        header, payload = client.request(WeightsRequest(generator_id=0, have_version=-1), timeout_s=10)
        client.close()
        assert isinstance(header, WeightsHeader) and header.policy_version == 1 and payload
        assert publisher.rejected["invalid_fields"] == 2
    finally:
        publisher.close()
    assert publisher.counters["rejected/invalid_fields"] == 2


def test_a_generators_relay_thread_survives_the_message_and_answers_chunk_requests() -> None:
    relay = open_relay_server("127.0.0.1", PLAIN, 0.1, generator_id=0)
    try:
        assert refused(send_raw(relay.address, poison("chunk_request", {"first": []}), role="generator"))
        client = Client(relay.address, PLAIN, "generator", role="generator")
        reply = client.request(ChunkRequest(generator_id=1, version=0, first=0, max_chunks=1), timeout_s=10)[0]
        client.close()
        assert isinstance(reply, (ChunkUnavailable,)) or reply.n_chunks == 0
        assert dict(relay.server.rejected) == {"invalid_fields": 1}
    finally:
        relay.close()


# ------------------------------------------------------------------------------------------------ the shared helper
def test_a_fault_while_handling_is_a_counted_answered_rejection_and_the_loop_serves_on(caplog) -> None:
    port = free_port()
    server = Server("127.0.0.1", port, PLAIN, name="faulty")

    def handle(request: Any) -> None:
        if request.message.max_prompts == 13:
            raise KeyError("a bug")
        server.reply(request, ErrorReply(reason="fine", kind="ok"))

    def loop() -> None:
        while not stop.is_set():
            request = server.poll(timeout_ms=20)
            if request is not None:
                serving.answer_safely(server, request, handle)

    stop = threading.Event()
    thread = threading.Thread(target=loop)
    thread.start()
    client = Client(f"127.0.0.1:{port}", PLAIN, "peer")
    try:
        replies = [client.request(LeaseRequest(0, 13, 0), timeout_s=10)[0] for _ in range(5)]
        assert all(r.kind == "internal_KeyError" for r in replies), replies
        assert client.request(LeaseRequest(0, 1, 0), timeout_s=10)[0].kind == "ok"
        assert server.rejected["internal_KeyError"] == 5
    finally:
        client.close()
        stop.set()
        thread.join(timeout=10)
        server.close()
    lines = [r for r in caplog.records if "internal_KeyError" in r.getMessage()]
    assert len(lines) == 2  # its traceback and its rejection, once per kind per interval: not once per message


def test_a_serving_thread_that_dies_is_restarted(monkeypatch) -> None:
    monkeypatch.setattr(serving, "RESTART_PAUSE_S", 0.01)
    runs: list[int] = []
    stop = threading.Event()

    def target() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError("housekeeping bug")
        stop.wait()

    thread = serving.supervised_thread(target, "test-serving", stop)
    wait_until(lambda: len(runs) == 3, 10, "two restarts")
    assert thread.is_alive()
    stop.set()
    thread.join(timeout=5)


def test_a_serving_thread_that_keeps_dying_takes_the_process_down(monkeypatch) -> None:
    monkeypatch.setattr(serving, "RESTART_PAUSE_S", 0.0)
    exits: list[int] = []
    monkeypatch.setattr(serving.os, "_exit", lambda code: (exits.append(code), time.sleep(3600)))
    serving.supervised_thread(lambda: 1 / 0, "test-dying")
    wait_until(lambda: exits, 10, "the process exit")
    assert exits == [serving.EXIT_SERVING_THREAD_DIED]


# ------------------------------------------------------------------------------------------------ the journal
def test_an_event_that_failed_to_apply_is_taken_out_of_the_journal(tmp_path: Path, monkeypatch) -> None:
    """Item 8: only decoded, accepted events are journaled; one whose applier raises is retracted, so a restart
    does not replay what broke the service. A journal that holds one anyway is skipped (counted), not fatal."""
    path = tmp_path / "journal.bin"
    journal = Journal(path)
    state = BufferState(make_settings(), fake_prompts(8), journal)
    state.restore(time.time())
    lease = state.grant(0, 0, 1, time.time())
    good_size = journal.size

    def broken(meta: dict, group: Any) -> None:
        raise ZeroDivisionError("a bug met by one group")

    monkeypatch.setitem(state._appliers, "group", broken)
    item = state.dispenser.items(lease)[0]
    with pytest.raises(ZeroDivisionError):
        state.accept(make_group(lease.lease_id, item, size=make_settings().group_size), time.time())
    assert journal.size == good_size == path.stat().st_size
    journal.close()

    restarted = BufferState(make_settings(), fake_prompts(8), Journal(path))
    assert restarted.restore(time.time()) >= 1
    assert len(restarted.replay) == 0 and lease.lease_id in restarted.dispenser.leases
    restarted.journal.close()
