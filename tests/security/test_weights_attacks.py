"""Issue 12, item 6: the weights path against hostile peers, over real loopback sockets. Each test plays one attack
and asserts that it fails and the service stays up.

Publisher (learners/publisher.py): a peer that asks for weights and never reads them kept every snapshot alive
(RSS 100 -> 676 MB). The attacker here is a raw DEALER that never calls recv, with RCVHWM 1 and a 4 KiB receive
buffer: its ZeroMQ takes in one reply and then stops reading the socket, so its next reply stalls on the publisher
(16 MiB, over the 4 MiB the kernel buffers at most: tcp_wmem). What it pins there is read from
`live_bucket_bytes()` (weak references to every bucket: what ZeroMQ still holds counts too), not from RSS.

Generator (actors/weights/updates.py): an unknown dtype in a header crashed it, and a forged version 10^9 stalled it for
good. A scripted fake publisher serves those replies; the poller must count each, ask again, and still load the
next good update.
"""

from __future__ import annotations

import struct
import time
from collections import deque
from typing import Any

import numpy as np
import pytest
import zmq

from actors.weights.updates import WeightsPoller, WeightsUpdate, ZmqWeightsSource
from common.sockets import Client, SocketSecurity
from common.types import ErrorReply
from common.weight_messages import TensorSpec, WeightsHeader, WeightsNotNewer, WeightsRequest
from common.wire import encode
from launch.testing import ServerThread, free_port, pack_weights, wait_until
from learners.publisher import ZmqWeightsPublisher
from tests.learners.learner_fakes import fetch_weights

BUCKET = 4 << 20  # 4 MiB buckets: far above pyzmq's copy threshold (64 KiB), so every reply is sent zero-copy
LAYOUT = [(f"layer.{i}", "float32", [BUCKET // 4]) for i in range(4)]
SNAPSHOT = 4 * BUCKET  # bytes of one version


def publish(publisher: ZmqWeightsPublisher, version: int) -> None:
    publisher.publish(version, LAYOUT, ((name, np.full(shape, version, np.float32)) for name, _, shape in LAYOUT))


class NonReader:
    """A peer that sends weight requests and never reads a reply."""

    def __init__(self, port: int) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.RCVHWM, 1)
        self.socket.setsockopt(zmq.RCVBUF, 4096)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.METADATA, b"X-Tandem-Role:generator")  # what a generator declares (no keys)
        self.socket.connect(f"tcp://127.0.0.1:{port}")
        self.sent = 0

    def ask(self) -> None:
        self.sent += 1
        request = encode(WeightsRequest(generator_id=99, have_version=-1))
        self.socket.send_multipart([b"", struct.pack("<Q", self.sent), *request])

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture
def served():
    """(publisher, its port): readers have 1 s to take a reply, 8 at once, 3 snapshots alive at most."""
    port = free_port()
    publisher = ZmqWeightsPublisher(
        "127.0.0.1", port, SocketSecurity(), bucket_bytes=BUCKET, reader_deadline_s=1.0, max_readers=8
    )
    try:
        yield publisher, port
    finally:
        publisher.close()


def newest_is_served(publisher: ZmqWeightsPublisher, port: int, version: int) -> None:
    client = Client(f"127.0.0.1:{port}", SocketSecurity(), identity="honest-generator", role="generator")
    try:
        header, arrays = fetch_weights(client, -1)
    finally:
        client.close()
    assert isinstance(header, WeightsHeader) and header.policy_version == version
    assert all(np.array_equal(arrays[name], np.full(shape, version, np.float32)) for name, _, shape in LAYOUT)


def test_peers_that_never_read_pin_at_most_max_snapshots(served) -> None:
    """Six non-reading peers take turns: at each of 20 versions one of them asks twice (the first reply is taken in,
    the second stalls on that version). Without the bounds every version stayed alive (20 x 16 MiB); now at most
    `max_snapshots` (3) are once the serving thread has looked (it drops the readers of the oldest), and an honest
    generator still gets the newest version byte-exact."""
    publisher, port = served
    attackers = [NonReader(port) for _ in range(6)]
    bound = publisher.max_snapshots * SNAPSHOT
    try:
        for version in range(20):
            publish(publisher, version)
            attackers[version % len(attackers)].ask()
            attackers[version % len(attackers)].ask()
            wait_until(lambda: publisher.live_bucket_bytes() <= bound, 10, f"<= {bound} live bytes after a publish")
        assert publisher.counters["dropped_readers/superseded"] + publisher.counters["dropped_readers/slow"] > 0
        newest_is_served(publisher, port, 19)
    finally:
        for attacker in attackers:
            attacker.close()


def test_a_reader_past_the_deadline_is_dropped_and_its_snapshot_freed(served) -> None:
    publisher, port = served
    attacker = NonReader(port)
    try:
        publish(publisher, 0)
        for _ in range(3):
            attacker.ask()  # the first reply is taken in, the second stalls, the third waits for it
        wait_until(lambda: publisher.counters["served"] == 2, 10, "the stalled reply to the non-reader")
        publish(publisher, 1)
        publish(publisher, 2)  # v0 is neither the latest nor the retired snapshot: only the non-reader holds it
        wait_until(lambda: publisher.counters["dropped_readers/slow"] == 1, 10, "the non-reader dropped")
        # what stays: v2 (latest) and v1 (retired, kept for reuse); v0's buckets are freed
        wait_until(lambda: publisher.live_bucket_bytes() <= 2 * SNAPSHOT, 10, "v0's buckets freed")
        assert publisher.counters["dropped_readers/not_disconnected"] == 0
        newest_is_served(publisher, port, 2)
    finally:
        attacker.close()


def test_more_readers_than_allowed_are_refused_not_queued() -> None:
    port = free_port()
    publisher = ZmqWeightsPublisher(
        "127.0.0.1", port, SocketSecurity(), bucket_bytes=BUCKET, reader_deadline_s=30.0, max_readers=2
    )
    attackers = [NonReader(port) for _ in range(2)]
    try:
        publish(publisher, 0)
        for attacker in attackers:
            attacker.ask()
            attacker.ask()  # the second reply stalls: both reader slots are taken for 30 s
        wait_until(lambda: publisher.counters["served"] == 4, 10, "both non-readers' second replies")
        client = Client(f"127.0.0.1:{port}", SocketSecurity(), identity="late-generator", role="generator")
        try:
            reply, _ = client.request(WeightsRequest(generator_id=0, have_version=-1), timeout_s=10)
        finally:
            client.close()
        assert isinstance(reply, ErrorReply) and "sending to 2 readers already" in reply.reason
        assert publisher.live_bucket_bytes() == SNAPSHOT  # one version, however many asked
    finally:
        for attacker in attackers:
            attacker.close()
        publisher.close()


# ---------------------------------------------------------------------------------------------------- generator
GOOD = {"model.norm.weight": np.linspace(-1, 1, 40, dtype=np.float32)}


class ScriptedPublisher(ServerThread):
    """Answers a weights request with the next scripted (header, buckets) if that header's version is newer than
    the request's `have_version`, else with WeightsNotNewer(latest)."""

    name = "scripted-publisher"

    def __init__(self, port: int, script: list[tuple[WeightsHeader, list[Any]]], latest: int) -> None:
        super().__init__(port)
        self.script = deque(script)
        self.latest = latest
        self.requests: list[WeightsRequest] = []

    def answer(self, server: Any, request: Any) -> list[tuple[Any, Any, list[Any]]]:
        self.requests.append(request.message)
        if self.script and self.script[0][0].policy_version > request.message.have_version:
            return [(request, *self.script.popleft())]
        return [(request, WeightsNotNewer(latest_version=self.latest), [])]


def with_spec(header: WeightsHeader, **changes: Any) -> WeightsHeader:
    spec = header.tensors[0]
    fields = {name: getattr(spec, name) for name in ("name", "dtype", "shape", "bucket", "offset", "nbytes")}
    return WeightsHeader(header.policy_version, [TensorSpec(**{**fields, **changes})], header.bucket_sizes)


def fetch_until_loaded(poller: WeightsPoller, have_version: int) -> WeightsUpdate:
    return wait_until(lambda: poller.poll(time.monotonic(), have_version), 30, "the good update")


def test_a_generator_survives_bad_headers_and_a_forged_version_then_loads_the_next_good_update() -> None:
    header, buckets = pack_weights(GOOD, 3)
    unknown_dtype = with_spec(header, dtype="complex512")  # crashed the generator before (a ValueError)
    short_payload = with_spec(header, shape=[41], nbytes=164)  # more bytes than the bucket holds
    forged = WeightsHeader(10**9, header.tensors, header.bucket_sizes)  # would have stalled it for good
    script = [(unknown_dtype, buckets), (short_payload, buckets), (forged, buckets), (header, buckets)]
    server = ScriptedPublisher(free_port(), script, latest=3).start()
    source = ZmqWeightsSource(f"127.0.0.1:{server.port}", SocketSecurity(), generator_id=0, timeout_s=10)
    poller = WeightsPoller(source, poll_s=0.1, backoff_max_s=0.2)
    try:
        update = fetch_until_loaded(poller, have_version=0)
        assert update.policy_version == 3
        assert poller.failures == {"bad_reply": 2, "implausible_version": 1}
        assert update.buckets[0].tobytes() == bytes(buckets[0])
        assert [r.have_version for r in server.requests] == [0, 0, 0, 0]  # the forged version was never adopted
    finally:
        poller.close()
        server.stop()


def test_a_generator_that_adopted_a_forged_version_returns_to_the_learners_weights() -> None:
    """A forged version within the lead bound (v50 while the learner is at v3) was adopted: the publisher's answer
    "nothing newer, my latest is v3" shows it. The poller then fetches the publisher's latest whatever its number
    (have_version -1), and the generator is back on v3 at the next poll instead of waiting for the learner to
    reach v50."""
    header, buckets = pack_weights(GOOD, 3)
    server = ScriptedPublisher(free_port(), [(header, buckets)], latest=3).start()
    source = ZmqWeightsSource(f"127.0.0.1:{server.port}", SocketSecurity(), generator_id=0, timeout_s=10)
    poller = WeightsPoller(source, poll_s=0.1, backoff_max_s=0.2)
    try:
        update = fetch_until_loaded(poller, have_version=50)
        assert update.policy_version == 3 and poller.failures == {"version_regressed": 1}
        assert [r.have_version for r in server.requests] == [50, -1]
    finally:
        poller.close()
        server.stop()


@pytest.mark.parametrize("role", ["learner", "monitor", None])
def test_only_roles_that_sample_get_weights(served, role: str | None) -> None:
    """Weights go to generators (and evaluators) only: a peer of another role, or of none, is refused and counted,
    and the publisher goes on serving generators."""
    publisher, port = served
    publish(publisher, 1)
    client = Client(f"127.0.0.1:{port}", SocketSecurity(), identity="other-role", role=role)
    try:
        reply, payload = client.request(WeightsRequest(generator_id=0, have_version=-1), timeout_s=10)
    finally:
        client.close()
    assert isinstance(reply, ErrorReply) and "may not fetch weights" in reply.reason and not payload
    newest_is_served(publisher, port, 1)
    publisher.close()  # the serving thread adds the socket's rejections to the counters as it stops
    assert publisher.counters["rejected/forbidden_role"] == 1
