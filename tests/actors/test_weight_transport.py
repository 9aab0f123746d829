"""Receiving weights (actors/weights/updates.py): the ZeroMQ source, the background poller, shared-memory staging."""

from __future__ import annotations

import time

import numpy as np
import pytest

from actors.weights.updates import (
    SharedMemoryStaging,
    WeightsPoller,
    WeightsTransportError,
    WeightsUpdate,
    ZmqWeightsSource,
)
from common.sockets import SocketSecurity
from common.weight_messages import WeightsHeader
from common.weights import storage_dtype
from launch.testing import FakePublisher, free_port
from tests.shm_fakes import small_shared_memory

ARRAYS = {
    "model.embed_tokens.weight": np.arange(6 * 40, dtype=np.uint16).reshape(6, 40),
    "model.norm.weight": np.linspace(-1, 1, 40, dtype=np.float32),
}
DTYPES = {"model.embed_tokens.weight": "bfloat16"}


@pytest.fixture
def publisher():
    server = FakePublisher(free_port(), bucket_bytes=256).start()
    try:
        yield server
    finally:
        server.stop()


def test_source_reports_nothing_newer_then_receives_an_update(publisher):
    source = ZmqWeightsSource(f"127.0.0.1:{publisher.port}", SocketSecurity(), generator_id=3, timeout_s=5)
    try:
        assert source.fetch(have_version=0) == 0
        publisher.publish(2, ARRAYS, DTYPES)
        update = source.fetch(have_version=0)
        assert isinstance(update, WeightsUpdate) and update.policy_version == 2
        assert len(update.buckets) == len(update.header.bucket_sizes) > 1  # 256-byte buckets: several frames
        assert source.fetch(have_version=2) == 2
        assert publisher.requests[-1].generator_id == 3
    finally:
        source.close()


def test_staged_file_holds_every_tensor_at_its_offset_and_is_reused(publisher):
    source = ZmqWeightsSource(f"127.0.0.1:{publisher.port}", SocketSecurity(), generator_id=0, timeout_s=5)
    staging = SharedMemoryStaging()
    try:
        for version, scale in ((1, 1), (2, 3)):
            arrays = {**ARRAYS, "model.norm.weight": ARRAYS["model.norm.weight"] * scale}
            publisher.publish(version, arrays, DTYPES)
            tensors = staging.write(source.fetch(version - 1))
            data = staging.path.read_bytes()
            for name, dtype, shape, offset, nbytes in tensors:
                assert offset % 64 == 0
                items = nbytes // storage_dtype(dtype).itemsize
                view = np.frombuffer(data, storage_dtype(dtype), count=items, offset=offset)
                np.testing.assert_array_equal(view.reshape(shape), arrays[name])
            assert [t[1] for t in tensors] == ["bfloat16", "float32"]
    finally:
        source.close()
        staging.close()
    assert not staging.path.exists()


def test_poller_never_blocks_and_backs_off_while_the_publisher_is_away():
    port = free_port()
    source = ZmqWeightsSource(f"127.0.0.1:{port}", SocketSecurity(), generator_id=0, timeout_s=1.0)
    poller = WeightsPoller(source, poll_s=0.1, backoff_max_s=0.5)
    try:
        start = time.monotonic()
        assert poller.poll(start, have_version=0) is None  # starts a fetch in the background
        assert time.monotonic() - start < 1.0  # a poll that blocked would wait out the fetch's whole 1 s timeout
        assert poller.wait(have_version=0, timeout_s=5) is None
        assert poller.failures["unreachable"] == 1 and poller.next_poll > time.monotonic()

        publisher = FakePublisher(port).start()
        try:
            publisher.publish(4, ARRAYS, DTYPES)
            poller.want(4)
            deadline, update = time.monotonic() + 10, None
            while update is None and time.monotonic() < deadline:
                update = poller.poll(time.monotonic(), have_version=0)
                time.sleep(0.01)
            assert update is not None and update.policy_version == 4 and poller.latest_seen == 4
        finally:
            publisher.stop()
    finally:
        poller.close()


class _NcclPublisher(FakePublisher):
    def answer(self, server, request):
        return [(request, WeightsHeader(policy_version=9, tensors=[], bucket_sizes=[], transport="nccl"), [])]


def test_an_unsupported_transport_is_refused_not_misread():
    server = _NcclPublisher(free_port()).start()
    source = ZmqWeightsSource(f"127.0.0.1:{server.port}", SocketSecurity(), generator_id=0, timeout_s=5)
    try:
        with pytest.raises(WeightsTransportError, match="nccl"):
            source.fetch(0)
    finally:
        source.close()
        server.stop()


def test_poller_works_with_a_long_polling_publisher():
    """A publisher may hold a request until it has something newer: the update then arrives as soon as published."""
    server = FakePublisher(free_port(), hold_s=10.0).start()
    poller = WeightsPoller(ZmqWeightsSource(f"127.0.0.1:{server.port}", SocketSecurity(), 0, timeout_s=30), 1.0, 1.0)
    try:
        assert poller.poll(time.monotonic(), have_version=0) is None  # held by the publisher
        time.sleep(0.3)
        assert poller.poll(time.monotonic(), have_version=0) is None
        server.publish(1, ARRAYS, DTYPES)
        published = time.monotonic()
        update = None
        while update is None and time.monotonic() - published < 5:
            update = poller.poll(time.monotonic(), have_version=0)
            time.sleep(0.002)
        assert update is not None and update.policy_version == 1
        # one held request, no polling; and it was answered when the update was published, not when the 10 s hold
        # ran out (1 s: a generous latency for a loaded machine, 10x under the hold)
        assert time.monotonic() - published < 1.0 and len(server.requests) == 1
    finally:
        poller.close()
        server.stop()


class _GatedSource:
    """A source whose fetch returns version 3 once `gate` is set (a transfer that ends while the loop sleeps)."""

    def __init__(self) -> None:
        import threading

        self.gate = threading.Event()

    def fetch(self, have_version: int) -> int:
        self.gate.wait(60)
        return 3

    def close(self) -> None:
        self.gate.set()


def test_idle_wait_wakes_when_the_running_fetch_finishes_and_sleeps_plainly_without_one():
    import threading

    source = _GatedSource()
    poller = WeightsPoller(source, poll_s=100.0, backoff_max_s=1.0)
    try:
        poller.idle_wait(0.001)  # no fetch yet: a plain sleep
        assert poller.poll(time.monotonic(), have_version=0) is None  # starts the (gated) fetch
        threading.Timer(0.05, source.gate.set).start()
        start = time.monotonic()
        poller.idle_wait(60.0)  # must return when the fetch finishes, not after 60 s
        assert time.monotonic() - start < 30.0, "idle_wait slept past a finished fetch"
        assert poller.poll(time.monotonic(), have_version=0) is None and poller.latest_seen == 3
        poller.idle_wait(0.001)  # a fetch collected: nothing to wake on, a plain sleep again
    finally:
        poller.close()


def test_staging_moves_out_of_a_shared_memory_too_small_for_the_update(publisher, tmp_path, monkeypatch):
    shm, tmp = small_shared_memory(monkeypatch, tmp_path, free_bytes=100)  # the update is ~1 KB
    source = ZmqWeightsSource(f"127.0.0.1:{publisher.port}", SocketSecurity(), generator_id=0, timeout_s=5)
    staging = SharedMemoryStaging(shm)
    try:
        publisher.publish(1, ARRAYS, DTYPES)
        path, tensors = staging.stage(source.fetch(0))
        assert path.parent == tmp and not list(shm.iterdir())  # moved, and nothing left in shared memory
        name, dtype, _, offset, nbytes = tensors[1]
        assert dtype == "float32"
        view = np.frombuffer(path.read_bytes(), np.float32, count=nbytes // 4, offset=offset)
        np.testing.assert_array_equal(view, ARRAYS[name])
    finally:
        source.close()
        staging.close()
    assert not path.exists()
