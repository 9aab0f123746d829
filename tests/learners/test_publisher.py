"""The weight publisher over real loopback sockets: byte-exact updates in the common.weights layout, versions,
no torn update while publishing concurrently, refusals that leave the service up."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from common.config import WeightsConfig
from common.sockets import Client, SocketSecurity
from common.types import ErrorReply, LeaseRequest
from common.weight_messages import WeightsHeader, WeightsNotNewer
from launch.testing import free_port
from learners.publisher import ZmqWeightsPublisher
from learners.snapshot import buckets_reusable, copy_into_snapshot
from tests.learners.learner_fakes import fetch_weights


def model_weights(version: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(version)
    return [
        ("model.embed_tokens.weight", torch.randn(100, 16, generator=gen).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(16, generator=gen)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(33, 16, generator=gen).to(torch.bfloat16)),
    ]


def layout_of(weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int]]]:
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in weights]


@pytest.fixture
def publisher_and_client():
    port = free_port()
    publisher = ZmqWeightsPublisher("127.0.0.1", port, SocketSecurity(), bucket_bytes=4096)
    client = Client(f"127.0.0.1:{port}", SocketSecurity(), identity="fake-generator", role="generator")
    try:
        yield publisher, client
    finally:
        client.close()
        publisher.close()


def test_generator_receives_the_published_bytes_and_only_newer_versions(publisher_and_client) -> None:
    publisher, client = publisher_and_client
    reply, _ = fetch_weights(client, -1)
    assert reply == WeightsNotNewer(latest_version=-1)  # nothing published yet
    weights = model_weights(3)
    publisher.publish(3, layout_of(weights), iter(weights))
    header, received = fetch_weights(client, -1)
    assert header.policy_version == 3 and header.transport == "zmq"
    assert len(header.bucket_sizes) > 1  # 4 KiB buckets: the embedding alone needs several
    assert [spec.dtype for spec in header.tensors] == ["bfloat16", "float32", "bfloat16"]
    for name, tensor in weights:
        sent = tensor.view(torch.uint16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()
        assert received[name].tobytes() == sent.tobytes(), name
    assert fetch_weights(client, 3)[0] == WeightsNotNewer(latest_version=3)
    assert fetch_weights(client, 7)[0] == WeightsNotNewer(latest_version=3)
    assert publisher.counters["served"] == 1 and publisher.counters["not_newer"] == 3


def test_no_update_is_torn_while_versions_are_published_concurrently(publisher_and_client) -> None:
    publisher, client = publisher_and_client
    layout = [(f"layer.{i}", "float32", [256, 256]) for i in range(6)]  # 1.5 MiB, 6 buckets
    seen: list[int] = []
    torn: list[tuple[int, set[float]]] = []
    stop = threading.Event()

    def generator_loop() -> None:
        while not stop.is_set():
            header, received = fetch_weights(client, -1)
            if isinstance(header, WeightsHeader):
                values = {float(a.min()) for a in received.values()} | {float(a.max()) for a in received.values()}
                if values != {float(header.policy_version)}:
                    torn.append((header.policy_version, values))
                seen.append(header.policy_version)

    thread = threading.Thread(target=generator_loop)
    thread.start()
    try:
        version = 0
        while len(set(seen)) < 10 and version < 5000:  # until the generator got 10 distinct versions
            publisher.publish(version, layout, ((n, np.full(s, version, np.float32)) for n, _, s in layout))
            version += 1
            time.sleep(0.002)
    finally:
        stop.set()
        thread.join(timeout=20)
    assert not torn
    assert len(seen) > 1 and seen == sorted(seen)
    assert publisher.counters["reused_buffers"] > 0  # double-buffering was exercised while serving


def test_buckets_are_reused_only_when_nothing_can_read_them() -> None:
    layout = [("w", "float32", [8])]
    first = copy_into_snapshot(1, layout, [("w", np.ones(8, np.float32))], bucket_bytes=1024)
    fresh = copy_into_snapshot(2, layout, [("w", np.full(8, 2.0, np.float32))], bucket_bytes=1024)
    assert first.buckets[0].view(np.float32).tolist() == [1.0] * 8  # without `buckets`: new memory
    assert buckets_reusable(first)
    in_flight = memoryview(first.buckets[0])  # what a zero-copy frame being sent holds
    assert not buckets_reusable(first)
    in_flight.release()
    assert buckets_reusable(first)
    first.readers = 1  # a serving thread took it and is about to send it
    assert not buckets_reusable(first)
    first.readers = 0
    reused = copy_into_snapshot(3, layout, [("w", np.full(8, 3.0, np.float32))], 1024, buckets=first.buckets)
    assert reused.buckets[0] is first.buckets[0] and fresh.buckets[0].view(np.float32)[0] == 2.0
    wrong_size = copy_into_snapshot(
        4, [("w", "float32", [9])], [("w", np.zeros(9, np.float32))], 1024, buckets=first.buckets
    )
    assert wrong_size.buckets[0] is not first.buckets[0]


def test_weights_that_do_not_match_the_layout_are_refused() -> None:
    weights = model_weights(0)
    layout = layout_of(weights)
    with pytest.raises(ValueError, match="out of layout order"):
        copy_into_snapshot(0, layout, reversed(weights), 1 << 20)
    with pytest.raises(ValueError, match="shape"):
        copy_into_snapshot(0, [(layout[0][0], "bfloat16", [10, 16]), *layout[1:]], iter(weights), 1 << 20)
    with pytest.raises(ValueError, match="dtype"):
        copy_into_snapshot(0, [(layout[0][0], "float32", [100, 16]), *layout[1:]], iter(weights), 1 << 20)
    with pytest.raises(ValueError):  # one tensor missing
        copy_into_snapshot(0, layout, iter(weights[:2]), 1 << 20)


def test_other_messages_are_refused_and_the_publisher_stays_up(publisher_and_client) -> None:
    _publisher, client = publisher_and_client
    reply, _ = client.request(LeaseRequest(generator_id=0, max_prompts=1, policy_version=0), timeout_s=10)
    assert isinstance(reply, ErrorReply) and "weights_request and chunk_request only" in reply.reason
    assert fetch_weights(client, -1)[0] == WeightsNotNewer(latest_version=-1)


def test_a_busy_port_fails_at_construction_and_an_unknown_transport_at_config_load(publisher_and_client) -> None:
    _publisher, client = publisher_and_client
    with pytest.raises(OSError, match="cannot bind"):
        ZmqWeightsPublisher("127.0.0.1", client.port, SocketSecurity())
    with pytest.raises(ValidationError, match="transport"):
        WeightsConfig(transport="carrier-pigeon")
