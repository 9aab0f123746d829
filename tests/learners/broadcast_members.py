"""Members of a gloo broadcast group for tests/learners/test_broadcast.py, each its own process:

    python -m tests.learners.broadcast_members publisher DOORBELL_PORT GROUP_PORT FLEET OUT_DIR VERSIONS
    python -m tests.learners.broadcast_members receiver  DOORBELL_PORT GROUP_PORT FLEET OUT_DIR INDEX [STOP_AFTER]

The publisher publishes versions 1..VERSIONS (`member_weights`), each once the previous round was sent, then writes
OUT_DIR/publisher.json (counters, failure, and the error of one more publish after a failure). A receiver fetches
until it holds VERSIONS (or STOP_AFTER, then exits at once: a member that dies; or until its first error), writing
every update's buckets to OUT_DIR/r{INDEX}-v{version}-b{bucket}.bin and its outcome to OUT_DIR/r{INDEX}.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from actors.broadcast_source import BroadcastWeightsSource
from actors.weights import WeightsTransportError, WeightsUpdate
from common.broadcast import BroadcastError
from common.sockets import PeerUnavailable, SocketSecurity
from learners.broadcast_publisher import BroadcastWeightsPublisher

BUCKET_BYTES = 8192  # several buckets: the embedding alone spans more than one
TIMEOUT_S = 5.0  # each collective; the test's dead member fails the round within it
JOIN_TIMEOUT_S = 60.0


def member_weights(version: int) -> list[tuple[str, torch.Tensor]]:
    """The same tensors for every process and transport: bfloat16, float32, float16 and int64."""
    gen = torch.Generator().manual_seed(version)
    return [
        ("model.embed_tokens.weight", torch.randn(100, 48, generator=gen).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(48, generator=gen)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(37, 48, generator=gen).to(torch.float16)),
        ("model.layers.0.counts", torch.randint(-(2**40), 2**40, (13,), generator=gen)),
        ("lm_head.weight", torch.randn(100, 48, generator=gen).to(torch.bfloat16)),
    ]


def layout_of(weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int]]]:
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in weights]


def run_publisher(doorbell: int, group: int, fleet: int, out: Path, versions: int) -> None:
    publisher = BroadcastWeightsPublisher(
        "127.0.0.1",
        doorbell,
        SocketSecurity(),
        ("127.0.0.1", group),
        fleet,
        "gloo",
        TIMEOUT_S,
        JOIN_TIMEOUT_S,
        bucket_bytes=BUCKET_BYTES,
    )
    outcome: dict = {}
    for version in range(1, versions + 1):
        weights = member_weights(version)
        publisher.publish(version, layout_of(weights), iter(weights))
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while publisher.counters["rounds"] < version and not publisher.failure and time.monotonic() < deadline:
            time.sleep(0.01)
        if publisher.failure:
            try:
                publisher.publish(version + 1, layout_of(weights), iter(weights))
            except BroadcastError as error:
                outcome["next_publish_error"] = str(error)
            break
    outcome.update(counters=dict(publisher.counters), failure=publisher.failure, bytes=publisher.bytes_by_version)
    time.sleep(0.5)  # receivers may still ask the doorbell once (answered not-newer or refused)
    publisher.close()
    (out / "publisher.json").write_text(json.dumps(outcome))


def run_receiver(doorbell: int, group: int, fleet: int, out: Path, index: int, want: int, stop_after: int) -> None:
    source = BroadcastWeightsSource(
        f"127.0.0.1:{doorbell}",
        SocketSecurity(),
        index,
        ("127.0.0.1", group),
        fleet,
        "gloo",
        TIMEOUT_S,
        JOIN_TIMEOUT_S,
        request_timeout_s=10.0,
    )
    have, errors = -1, []
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while have < want and time.monotonic() < deadline:
        try:
            result = source.fetch(have)
        except (WeightsTransportError, PeerUnavailable) as error:  # the group failed, or the publisher is gone
            errors.append(str(error))
            break
        if isinstance(result, WeightsUpdate):
            have = result.policy_version
            for i, bucket in enumerate(result.buckets):
                (out / f"r{index}-v{have}-b{i}.bin").write_bytes(bytes(bucket))
            if have == stop_after:
                os._exit(0)  # dies without leaving the group: the next round must fail, not hang
        else:
            time.sleep(0.02)
    (out / f"r{index}.json").write_text(json.dumps({"have": have, "errors": errors}))
    source.close()


if __name__ == "__main__":
    role, doorbell_port, group_port, fleet_size, out_dir = sys.argv[1:6]
    args = (int(doorbell_port), int(group_port), int(fleet_size), Path(out_dir))
    if role == "publisher":
        run_publisher(*args, int(sys.argv[6]))
    else:
        index = int(sys.argv[6])
        stop = int(sys.argv[7]) if len(sys.argv) > 7 else -1
        run_receiver(*args, index, 2, stop)
