"""Issue 37, item 5: the relay transport against one lying peer (a relay parent is another generator, possibly on
another host; a fake publisher; another local user). Each test plays one attack over real loopback sockets and
asserts that it is refused or bounded, and that an honest generator still gets the publisher's exact bytes.

Before the fix: two fake relay headers killed a generator (exit 1), chunk_bytes = 1 made it allocate 2.2 GB for a
16 MiB bucket, a child that never read pinned 16 MiB per request in its parent, a flood of fake tree members took a
fetch from 1 s to 62 s, and a store directory another user created first let that user's bytes be mapped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from actors.weights.host_copy import HostCopy, StoreDirError, private_store_dir
from actors.weights.relay import RelayServer, RelayWeightsSource
from actors.weights.updates import WeightsPoller, open_weights_source
from common.config import WeightsConfig
from common.sockets import Client, SocketSecurity, free_port
from common.weight_messages import ChunkReply, ChunkRequest, WeightsHeader, WeightsRequest
from common.wire import decode, encode
from launch.testing import pack_weights, wait_until
from learners.fanout import FanoutTree
from learners.publisher import ZmqWeightsPublisher
from tests.security.test_weights_attacks import ScriptedPublisher

MIB = 1 << 20
GOOD = {"model.norm.weight": np.linspace(-1, 1, 40, dtype=np.float32)}


def relay_source(port: int, store: Path, generator_id: int = 0, stall_s: float = 1.0) -> RelayWeightsSource:
    weights = WeightsConfig(host_id=f"host-{generator_id}", stall_timeout_s=stall_s)
    return open_weights_source(weights, f"127.0.0.1:{port}", SocketSecurity(), generator_id, store)


def sha(buckets) -> str:
    digest = hashlib.sha256()
    for bucket in buckets:
        digest.update(bucket)
    return digest.hexdigest()


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) / 1024


# -------------------------------------------------------------------------------------------- a fake publisher
def test_fake_relay_headers_are_refused_and_the_generator_loads_the_next_good_update(tmp_path) -> None:
    """A fake publisher's relay headers: a parent that is no address, a host copy of no generator, chunk_bytes = 1
    under a 16 MiB bucket, buckets larger than their tensors, a relayed update without digests. Each is counted as
    a bad reply (the generator stays up) before anything is allocated for it; the next good update loads."""
    header, buckets = pack_weights(GOOD, 3)
    relay = dataclasses.replace(header, transport="relay", chunk_bytes=1 << 16)
    big = {"model.embed.weight": np.zeros(4 * MIB, np.float32)}  # one 16 MiB bucket
    big_header, _ = pack_weights(big, 3)
    forged = [
        dataclasses.replace(relay, parent="not an address!", chunk_digests=["0" * 64]),
        dataclasses.replace(relay, parent="host:abc", chunk_digests=["0" * 64]),
        dataclasses.replace(big_header, transport="relay", chunk_bytes=1),  # 16.7 M chunks: 2.2 GB of ranges
        dataclasses.replace(relay, bucket_sizes=[1 << 40]),  # a TiB for 160 bytes of tensors
        dataclasses.replace(relay, parent="127.0.0.1:1"),  # relayed, no digests
    ]
    server = ScriptedPublisher(free_port(), [(h, []) for h in forged] + [(header, buckets)], latest=3).start()
    source = relay_source(server.port, tmp_path / "store")
    poller = WeightsPoller(source, poll_s=0.05, backoff_max_s=0.1)
    started = time.monotonic()
    try:
        update = wait_until(lambda: poller.poll(time.monotonic(), 0), 30, "the good update")
        assert update.policy_version == 3 and sha(update.buckets) == sha(buckets)
        assert poller.failures == {"bad_reply": len(forged)}
        assert time.monotonic() - started < 10  # nothing was built for 16.7 M chunks
        assert not list((tmp_path / "store").glob("*.bin"))  # nothing allocated for any forged header
    finally:
        poller.close()
        server.stop()


# ---------------------------------------------------------------------------------------- a child that never reads
class NonReadingChild:
    """A raw DEALER of role generator that asks for chunks and never reads (its ZeroMQ takes in one reply, then
    stops reading the socket)."""

    def __init__(self, address: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        for option, value in ((zmq.RCVHWM, 1), (zmq.RCVBUF, 4096), (zmq.LINGER, 0)):
            self.socket.setsockopt(option, value)
        self.socket.setsockopt(zmq.METADATA, b"X-Tandem-Role:generator")
        self.socket.connect(f"tcp://{address}")
        self.sent = 0

    def ask(self, version: int) -> None:
        self.sent += 1
        request = encode(ChunkRequest(generator_id=7, version=version, first=0, max_chunks=4))
        self.socket.send_multipart([b"", struct.pack("<Q", self.sent), *request])

    def close(self) -> None:
        self.socket.close(linger=0)


def written_copy(directory: Path, version: int) -> HostCopy:
    """A complete 16 MiB host copy (4 chunks of 4 MiB: one reply holds them all)."""
    header, _ = pack_weights({"w": np.ones(4 * MIB, np.float32)}, version)
    header = dataclasses.replace(header, transport="relay", chunk_bytes=4 * MIB)
    copy = HostCopy.create(directory, header, generator_id=0)
    for index in range(copy.total):
        _, start, end = copy.ranges[index]
        copy.write_chunk(index, b"\x01" * (end - start))
    return copy


def test_children_that_never_read_pin_bounded_memory_and_are_dropped(tmp_path) -> None:
    """Three non-reading children ask 20 times each for 16 MiB: the relay keeps one reply in flight per connection
    (320 MiB pinned before: 60 x 16 MiB queued in ZeroMQ), drops them past its deadline, and an honest child is
    still served."""
    relay = RelayServer("127.0.0.1", SocketSecurity(), hold_s=0.25, name="relay-test")
    relay.offer(written_copy(tmp_path, 1))
    children = [NonReadingChild(relay.address) for _ in range(3)]
    before = rss_mb()
    try:
        for _ in range(20):
            for child in children:
                child.ask(1)
        wait_until(lambda: relay.counters["requests_superseded"] > 0, 10, "the relay to supersede queued requests")
        assert relay.in_flight_bytes() <= 3 * 16 * MIB
        assert rss_mb() - before < 150  # 3 replies in flight at most, not 60
        assert relay.counters["requests_superseded"] > 0
        honest = Client(relay.address, SocketSecurity(), identity="honest-child", role="generator")
        try:
            reply, frames = honest.request(ChunkRequest(1, 1, 0, 4), timeout_s=5)
        finally:
            honest.close()
        assert isinstance(reply, ChunkReply) and reply.n_chunks == 4 and sum(f.nbytes for f in frames) == 16 * MIB
        wait_until(lambda: relay.counters["dropped_children"] >= 3, 10, "the non-readers dropped")
        wait_until(lambda: relay.in_flight_bytes() == 0, 10, "their replies freed")
    finally:
        for child in children:
            child.close()
        relay.close()


# ----------------------------------------------------------------------------------------- fake tree members
class FakeMembers:
    """One peer of its own (it connects from 127.0.0.2: the honest generators come from 127.0.0.1) that claims to
    be many generators."""

    def __init__(self, port: int) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.METADATA, b"X-Tandem-Role:generator")
        self.socket.connect(f"tcp://127.0.0.2:0;127.0.0.1:{port}")  # source address; destination
        self.sent = 0

    def request(self, message: WeightsRequest) -> object:
        self.sent += 1
        self.socket.send_multipart([b"", struct.pack("<Q", self.sent), *encode(message)])
        assert self.socket.poll(10_000), "the publisher did not answer"
        return decode(self.socket.recv_multipart()[2:], 1 << 30)[0]

    def close(self) -> None:
        self.socket.close(linger=0)


def test_a_flood_of_fake_tree_members_neither_slows_a_fetch_nor_grows_the_tree(tmp_path) -> None:
    """70 fake members (one peer, relay addresses nobody serves) ask for v1. One peer gets at most 64 members and 8
    of them offered as parents; an honest generator that gets a fake parent pulls from the publisher after 2
    failures: its fetch takes a few stall timeouts (0.5 s each), not one per fake (35 s before)."""
    port = free_port()
    publisher = ZmqWeightsPublisher(
        "127.0.0.1", port, SocketSecurity(), bucket_bytes=MIB, relay=FanoutTree(1, relay_fanout=1), chunk_bytes=MIB
    )
    fake = FakeMembers(port)
    first = relay_source(port, tmp_path / "store", generator_id=0, stall_s=0.5)
    honest = relay_source(port, tmp_path / "store", generator_id=1, stall_s=0.5)
    try:
        weights = {"w": np.arange(MIB // 2, dtype=np.float32)}  # 2 MiB
        publisher.publish(1, [("w", "float32", [MIB // 2])], weights.items())
        assert publisher.wait_for(1, timeout_s=10)
        assert first.fetch(-1).policy_version == 1  # the publisher's one direct child
        dead = free_port()  # nothing listens there
        refused = 0
        for fake_id in range(100, 170):
            request = WeightsRequest(fake_id, -1, relay_address=f"127.0.0.1:{dead}", host_id=f"fake-{fake_id}")
            refused += not isinstance(fake.request(request), WeightsHeader)
        assert refused == 70 - 64 and publisher.relay.counters["refused_members"] == 6
        assert publisher.relay.counters["leaves_over_quota"] > 0
        result: dict = {}
        thread = threading.Thread(target=lambda: result.setdefault("update", honest.fetch(-1)), daemon=True)
        started = time.monotonic()
        thread.start()
        thread.join(timeout=6)
        assert "update" in result, "the honest fetch is still stuck behind fake parents"
        assert time.monotonic() - started < 6
        assert np.array_equal(np.frombuffer(result["update"].buckets[0], np.float32), weights["w"])
    finally:
        for source in (first, honest):
            source.close()
        fake.close()
        publisher.close()


# ------------------------------------------------------------------------------------------ the host copy store
@pytest.mark.parametrize("attack", ["another_user", "world_writable", "symlink"])
def test_a_store_directory_others_own_or_may_write_is_refused(tmp_path, attack: str) -> None:
    store = tmp_path / "tandem-weights-predictable"
    if attack == "symlink":
        (tmp_path / "elsewhere").mkdir()
        store.symlink_to(tmp_path / "elsewhere")
    else:
        store.mkdir(mode=0o777)
        os.chmod(store, 0o777 if attack == "world_writable" else 0o700)
        if attack == "another_user":
            if os.getuid() != 0:
                pytest.skip("giving a directory to another user needs root")
            os.chown(store, 65534, 65534)
    with pytest.raises(StoreDirError, match="Remove it"):
        private_store_dir(store)
    with pytest.raises(StoreDirError):
        relay_source(free_port(), store)
    fresh = private_store_dir(tmp_path / "fresh")
    assert fresh.stat().st_mode & 0o777 == 0o700


def test_a_tampered_host_copy_is_refused_by_digest_and_the_reader_receives_its_own(tmp_path) -> None:
    """Two generators of one host: the first's finished copy is overwritten ("POISONED-WEIGHTS") before the second
    maps it. The second checks the copy against the publisher's digests, refuses it, and receives v1 itself."""
    port = free_port()
    publisher = ZmqWeightsPublisher(
        "127.0.0.1", port, SocketSecurity(), bucket_bytes=MIB, relay=FanoutTree(2, relay_fanout=1), chunk_bytes=MIB
    )
    store = tmp_path / "store"
    weights = {"w": np.arange(MIB // 2, dtype=np.float32)}
    host = WeightsConfig(host_id="one-host", stall_timeout_s=1.0)
    writer, reader = (open_weights_source(host, f"127.0.0.1:{port}", SocketSecurity(), i, store) for i in (0, 1))
    try:
        publisher.publish(1, [("w", "float32", [MIB // 2])], weights.items())
        assert publisher.wait_for(1, timeout_s=10)
        first = writer.fetch(-1)
        with open(store / "v1-g0.bin", "r+b") as file:  # the finished copy, rewritten in place
            file.seek(8192)
            file.write(b"POISONED-WEIGHTS")
        update = reader.fetch(-1)
        assert np.array_equal(np.frombuffer(update.buckets[0], np.float32), weights["w"])
        assert reader.counters["bad_host_copies"] == 1 and reader.counters["host_copies_mapped"] == 0
        assert reader.counters["reattached/bad_chunk"] == 1
        del first
    finally:
        writer.close()
        reader.close()
        publisher.close()
