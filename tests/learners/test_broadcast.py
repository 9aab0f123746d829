"""The broadcast transport (learners/broadcast_publisher.py, actors/broadcast_source.py, common/broadcast.py) in its
gloo form, with real processes: what every receiver gets equals, byte for byte, what the ZeroMQ path delivers; a
member that dies fails the round on the others within the timeout (no hang) and the next publish says so. And the
configurations that cannot work are refused up front."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from actors.broadcast_source import open_broadcast_source
from actors.weights import ZmqWeightsSource
from common.config import WeightsConfig
from common.sockets import SocketSecurity
from launch.testing import free_port
from learners.publisher import ZmqWeightsPublisher, open_weights_publisher
from tests.learners.broadcast_members import BUCKET_BYTES, layout_of, member_weights

REPO = Path(__file__).resolve().parents[2]


def _zmq_buckets(version: int) -> list[bytes]:
    """The bucket bytes the star (ZeroMQ) path delivers for `member_weights(version)`."""
    port = free_port()
    publisher = ZmqWeightsPublisher("127.0.0.1", port, SocketSecurity(), bucket_bytes=BUCKET_BYTES)
    source = ZmqWeightsSource(f"127.0.0.1:{port}", SocketSecurity(), generator_id=0)
    try:
        weights = member_weights(version)
        publisher.publish(version, layout_of(weights), iter(weights))
        update = source.fetch(-1)
        return [bytes(bucket) for bucket in update.buckets]
    finally:
        source.close()
        publisher.close()


def _start(*args: object) -> subprocess.Popen:
    command = [sys.executable, "-m", "tests.learners.broadcast_members", *map(str, args)]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(process: subprocess.Popen, timeout_s: float = 120) -> str:
    output, _ = process.communicate(timeout=timeout_s)
    return output


@pytest.mark.integration
def test_gloo_broadcast_equals_the_zeromq_path_byte_for_byte(tmp_path: Path) -> None:
    doorbell, group = free_port(), free_port()
    receivers = [_start("receiver", doorbell, group, 2, tmp_path, index) for index in range(2)]
    publisher = _start("publisher", doorbell, group, 2, tmp_path, 2)  # started last: members join in any order
    for process in (publisher, *receivers):
        output = _finish(process)
        assert process.returncode == 0, output
    outcome = json.loads((tmp_path / "publisher.json").read_text())
    assert outcome["failure"] == "" and outcome["counters"]["rounds"] == 2
    for version in (1, 2):
        expected = _zmq_buckets(version)
        assert len(expected) > 2  # 8 KiB buckets: a multi-bucket layout
        assert outcome["bytes"][str(version)] == sum(map(len, expected))  # once per update, for the whole fleet
        for index in range(2):
            got = [(tmp_path / f"r{index}-v{version}-b{i}.bin").read_bytes() for i in range(len(expected))]
            assert got == expected, f"receiver {index} v{version}"
            assert not (tmp_path / f"r{index}-v{version}-b{len(expected)}.bin").exists()
    for index in range(2):
        assert json.loads((tmp_path / f"r{index}.json").read_text()) == {"have": 2, "errors": []}


@pytest.mark.integration
def test_a_member_that_dies_fails_the_round_within_the_timeout_and_the_next_publish_says_so(tmp_path: Path) -> None:
    doorbell, group = free_port(), free_port()
    dying = _start("receiver", doorbell, group, 2, tmp_path, 0, 1)  # exits right after v1
    survivor = _start("receiver", doorbell, group, 2, tmp_path, 1)
    publisher = _start("publisher", doorbell, group, 2, tmp_path, 2)
    for process in (publisher, dying, survivor):
        output = _finish(process)
        assert process.returncode == 0, output
    outcome = json.loads((tmp_path / "publisher.json").read_text())
    assert outcome["counters"]["rounds"] == 1 and outcome["counters"]["failed"] == 1
    assert "broadcast round failed at rank 0" in outcome["failure"]
    assert "weights.transport = 'relay'" in outcome["next_publish_error"]
    survived = json.loads((tmp_path / "r1.json").read_text())
    assert survived["have"] == 1  # it keeps v1; v2's round failed (the doorbell may refuse it before that round)
    assert survived["errors"] and any("broadcast" in error for error in survived["errors"])
    assert (tmp_path / "r0-v1-b0.bin").read_bytes() == (tmp_path / "r1-v1-b0.bin").read_bytes()


def test_configurations_that_cannot_work_are_refused_up_front() -> None:
    insecure_host = WeightsConfig(transport="broadcast", broadcast_fleet_size=2, broadcast_host="10.1.2.3")
    with pytest.raises(ValueError, match="run.insecure"):
        open_weights_publisher(insecure_host, "127.0.0.1", free_port(), SocketSecurity())
    with pytest.raises(ValueError, match="broadcast_fleet_size >= 1"):
        open_weights_publisher(WeightsConfig(transport="broadcast"), "127.0.0.1", free_port(), SocketSecurity())
    outside = WeightsConfig(transport="broadcast", broadcast_fleet_size=2, broadcast_backend="gloo")
    with pytest.raises(ValueError, match="outside the broadcast group"):
        open_broadcast_source(outside, "127.0.0.1:1", SocketSecurity(), generator_id=2)
    if not torch.cuda.is_available():
        nccl = WeightsConfig(transport="broadcast", broadcast_fleet_size=2, broadcast_backend="nccl")
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            open_weights_publisher(nccl, "127.0.0.1", free_port(), SocketSecurity())
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            open_broadcast_source(nccl, "127.0.0.1:1", SocketSecurity(), generator_id=0)
