"""The broadcast transport (learners/broadcast_publisher.py, actors/weights/broadcast_source.py, common/broadcast.py) in its
gloo form, with real processes: what every worker of every generator gets equals, byte for byte, what the ZeroMQ
path delivers; a member that dies mid-round costs that round only; a generator that joins later takes the next
round. And the configurations that cannot work are refused up front. Inside vLLM's workers:
tests/actors/test_broadcast_vllm.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from actors.weights.broadcast_source import open_broadcast_source
from actors.weights.updates import ZmqWeightsSource
from common.config import ConfigError, WeightsConfig, load_config
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


def _outcomes(tmp_path: Path, receivers: int) -> tuple[dict, list[dict]]:
    publisher = json.loads((tmp_path / "publisher.json").read_text())
    return publisher, [json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(receivers)]


@pytest.mark.integration
def test_every_worker_of_every_generator_receives_the_zeromq_bytes(tmp_path: Path) -> None:
    """Two generators, one with two workers (tensor parallelism 2: two group ranks): both rounds reach every
    worker byte for byte as the ZeroMQ path delivers them, once per update for the whole fleet, in one group."""
    doorbell, group = free_port(), free_port()
    receivers = [
        _start("receiver", doorbell, group, tmp_path, index, 2, workers) for index, workers in ((0, 1), (1, 2))
    ]
    # started last (members come in any order); round 1 waits until both have asked the doorbell
    publisher = _start("publisher", doorbell, group, tmp_path, 2, 1.0, "2")
    for process in (publisher, *receivers):
        output = _finish(process)
        assert process.returncode == 0, output
    outcome, members = _outcomes(tmp_path, 2)
    assert outcome["counters"]["rounds"] == 2 and outcome["counters"].get("failed_rounds", 0) == 0
    assert outcome["counters"]["epochs"] == 1  # the same members both rounds: the group is kept
    for version in (1, 2):
        expected = _zmq_buckets(version)
        assert len(expected) > 2  # 8 KiB buckets: a multi-bucket layout
        assert outcome["bytes"][str(version)] == sum(map(len, expected))  # once per update, for the whole fleet
        for index in range(2):
            got = [(tmp_path / f"r{index}-v{version}-b{i}.bin").read_bytes() for i in range(len(expected))]
            assert got == expected, f"receiver {index} v{version}"
    assert [m["received"] for m in members] == [[1, 2], [1, 2]]


@pytest.mark.integration
def test_a_member_that_dies_mid_round_costs_that_round_only(tmp_path: Path) -> None:
    """Generator 0 joins round 2's group and dies: round 2 fails within broadcast_timeout_s on the others (no
    hang), and round 3 forms a new group with the survivor, which receives it. Not fatal to the fleet."""
    doorbell, group = free_port(), free_port()
    dying = _start("receiver", doorbell, group, tmp_path, 0, 3, 1, 2)
    survivor = _start("receiver", doorbell, group, tmp_path, 1, 3, 1)
    publisher = _start("publisher", doorbell, group, tmp_path, 3, 1.0, "2")  # round 1 once both have asked
    for process in (publisher, dying, survivor):
        output = _finish(process)
        assert process.returncode == 0, output
    outcome, _ = _outcomes(tmp_path, 0)
    survived = json.loads((tmp_path / "r1.json").read_text())  # generator 0 died: it wrote nothing
    counters = outcome["counters"]
    assert counters["failed_rounds"] == 1 and counters["rounds"] == 2 and counters["epochs"] == 2
    assert survived["received"] == [1, 3] and any("round v2" in e for e in survived["errors"])
    assert (tmp_path / "r1-v3-b0.bin").read_bytes() == _zmq_buckets(3)[0]


@pytest.mark.integration
def test_a_generator_that_joins_later_gets_the_next_round(tmp_path: Path) -> None:
    """Elastic membership: generator 1 starts after round 1 was sent (it is told so: a missed round) and takes
    round 2, in a group re-formed with it (the time to form each group is measured)."""
    doorbell, group = free_port(), free_port()
    first = _start("receiver", doorbell, group, tmp_path, 0, 2, 1)
    # round 1 once the first generator has asked the doorbell, round 2 once the late one has too
    publisher = _start("publisher", doorbell, group, tmp_path, 2, 1.0, "1,2")
    deadline = time.monotonic() + 60
    while not (tmp_path / "r0-v1-b0.bin").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    late = _start("receiver", doorbell, group, tmp_path, 1, 2, 1)
    for process in (publisher, first, late):
        output = _finish(process)
        assert process.returncode == 0, output
    outcome, members = _outcomes(tmp_path, 2)
    assert outcome["counters"]["rounds"] == 2 and outcome["counters"]["epochs"] == 2
    assert members[0]["received"] == [1, 2] and members[1]["received"] == [2]
    assert len(outcome["epoch_form_s"]) == 2 and max(outcome["epoch_form_s"]) < 10.0  # within the join timeout
    assert (tmp_path / "r1-v2-b0.bin").read_bytes() == _zmq_buckets(2)[0]


def test_configurations_that_cannot_work_are_refused_up_front() -> None:
    with pytest.raises(ConfigError, match="no vLLM"):  # the rounds are received inside vLLM's workers
        load_config(None, ["--weights.transport", "broadcast", "--run.simulate", "true"])
    insecure_host = WeightsConfig(transport="broadcast", broadcast_host="10.1.2.3")
    with pytest.raises(ValueError, match="run.insecure"):
        open_weights_publisher(insecure_host, "127.0.0.1", free_port(), SocketSecurity())
    if not torch.cuda.is_available():
        nccl = WeightsConfig(transport="broadcast", broadcast_backend="nccl")
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            open_weights_publisher(nccl, "127.0.0.1", free_port(), SocketSecurity())
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            open_broadcast_source(nccl, "127.0.0.1:1", SocketSecurity(), generator_id=0)
