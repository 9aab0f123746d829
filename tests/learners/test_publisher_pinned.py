"""learners/publisher with weights on a CUDA device (review finding 13), on CPU with the device parts faked: the
snapshot's host buckets are pinned ones, allocated once per double-buffered set and reused while the layout holds,
the copies are queued and waited for once per publish, and what is served is byte-exact. What cannot run here:
real page-locked memory and the asynchronous device-to-host copies (benchmarks/gpu_check.py, on a GPU)."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from common.sockets import Client, SocketSecurity
from launch.testing import free_port
from learners import snapshot as snapshot_module
from learners.publisher import ZmqWeightsPublisher
from learners.snapshot import buckets_reusable, copy_into_snapshot
from tests.learners.learner_fakes import fetch_weights
from tests.learners.test_publisher import layout_of, model_weights


@pytest.fixture
def fake_cuda(monkeypatch):
    """Every torch tensor counts as on a CUDA device; 'pinned' buckets are numpy views of torch tensors, as the
    real ones are, recorded (weakly: a reference would count as a reader) when allocated; waits are counted."""
    fake = SimpleNamespace(allocations=[], pinned=weakref.WeakValueDictionary(), waits=[])

    def pinned_buckets(sizes):
        buckets = [torch.empty(size, dtype=torch.uint8).numpy() for size in sizes]
        fake.allocations.append(list(sizes))
        fake.pinned.update({id(bucket): bucket for bucket in buckets})
        return buckets

    def pinned(buckets) -> bool:
        return all(fake.pinned.get(id(bucket)) is bucket for bucket in buckets)

    # raising=False: the same fakes can be applied to a publisher without these helpers
    monkeypatch.setattr(snapshot_module, "_cuda_device", lambda tensor: "cuda:0", raising=False)
    monkeypatch.setattr(snapshot_module, "_pinned_buckets", pinned_buckets, raising=False)
    monkeypatch.setattr(snapshot_module, "_pinned", pinned, raising=False)
    monkeypatch.setattr(snapshot_module, "_wait_for_copies", fake.waits.append, raising=False)
    return fake


def bucket_bytes_of(weights) -> bytes:
    return b"".join((t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy().tobytes() for _, t in weights)


def spec_bytes(snapshot, spec) -> bytes:
    return snapshot.buckets[spec.bucket][spec.offset : spec.offset + spec.nbytes].tobytes()


def test_device_weights_go_into_pinned_buckets_reused_while_the_layout_holds(fake_cuda) -> None:
    weights = model_weights(1)
    layout = layout_of(weights)
    first = copy_into_snapshot(1, layout, iter(weights), 4096)
    sizes = first.header.bucket_sizes
    assert fake_cuda.allocations == [sizes] and fake_cuda.waits == ["cuda:0"]  # one wait per publish
    again = copy_into_snapshot(2, layout, iter(model_weights(2)), 4096, buckets=first.buckets)
    assert fake_cuda.allocations == [sizes] and len(fake_cuda.waits) == 2
    assert all(a is b for a, b in zip(again.buckets, first.buckets, strict=True))
    pageable = [np.empty(size, dtype=np.uint8) for size in sizes]  # the right size, but not pinned: replaced
    third = copy_into_snapshot(3, layout, iter(model_weights(3)), 4096, buckets=pageable)
    assert fake_cuda.allocations == [sizes, sizes] and not any(a is b for a, b in zip(third.buckets, pageable))
    for snapshot, version in ((again, 2), (third, 3)):
        received = b"".join(spec_bytes(snapshot, spec) for spec in snapshot.header.tensors)
        assert received == bucket_bytes_of(model_weights(version))


def test_a_failed_publish_still_waits_for_the_copies_it_queued(fake_cuda) -> None:
    weights = model_weights(1)
    layout = layout_of(weights)
    wrong = [layout[0], (layout[1][0], "float32", [8]), *layout[2:]]  # the first copy is queued, the second fails
    with pytest.raises(ValueError, match="shape"):
        copy_into_snapshot(1, wrong, iter(weights), 4096)
    assert fake_cuda.waits == ["cuda:0"]


def test_the_publisher_reuses_its_pinned_buckets_and_serves_them_byte_exact(fake_cuda) -> None:
    port = free_port()
    publisher = ZmqWeightsPublisher("127.0.0.1", port, SocketSecurity(), bucket_bytes=4096)
    client = Client(f"127.0.0.1:{port}", SocketSecurity(), identity="fake-generator", role="generator")
    try:
        for version in (1, 2, 3):
            weights = model_weights(version)
            publisher.publish(version, layout_of(weights), iter(weights))
        assert len(fake_cuda.allocations) == 2  # the latest and the retired set, then the retired one reused
        assert publisher.counters["reused_buffers"] == 1 and len(fake_cuda.waits) == 3
        header, received = fetch_weights(client, -1)
        assert header.policy_version == 3
        for name, tensor in model_weights(3):
            sent = tensor.view(torch.uint16) if tensor.dtype == torch.bfloat16 else tensor
            assert received[name].tobytes() == sent.numpy().tobytes(), name
    finally:
        client.close()
        publisher.close()


def test_a_frame_in_flight_holds_a_tensor_backed_bucket() -> None:
    """The reuse rule counts references to the bucket itself: a view of a numpy view of a torch tensor must
    reference that view, not the tensor, or a bucket would be rewritten under a reply ZeroMQ is sending."""
    snapshot = copy_into_snapshot(1, [("w", "float32", [8])], [("w", np.ones(8, np.float32))], 1024)
    snapshot.buckets = [torch.zeros(snapshot.buckets[0].nbytes, dtype=torch.uint8).numpy()]
    assert buckets_reusable(snapshot)
    frames = [snapshot.buckets[0].view(), snapshot.buckets[0][0:16]]  # a star reply's frame, a relay chunk's
    assert not buckets_reusable(snapshot)
    del frames
    assert buckets_reusable(snapshot)
