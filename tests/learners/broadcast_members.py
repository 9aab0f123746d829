"""Members of a gloo broadcast fleet for tests/learners/test_broadcast.py, each its own process:

    python -m tests.learners.broadcast_members publisher DOORBELL GROUP_PORT OUT_DIR VERSIONS [PAUSE_S [HEARD]]
    python -m tests.learners.broadcast_members receiver  DOORBELL GROUP_PORT OUT_DIR INDEX WANT WORKERS [DIE_IN]

The publisher publishes versions 1..VERSIONS (`member_weights`), each once the previous round ended (sent or
failed), PAUSE_S passed and as many generators as HEARD says for it have asked its doorbell (HEARD: counts by
version separated by commas, "1,2" = one before version 1, two before version 2; none past the list): processes
start in any order, and one that starts slowly on a loaded machine would otherwise miss its round. Then it writes
OUT_DIR/publisher.json (counters, bytes per version, epoch forming times).
A receiver plays a generator with WORKERS vLLM workers: it fetches, seals the round (`BroadcastWeightsSource`) and
receives it in one thread per worker, each its own group rank, as `actors.weights.transfer` does inside vLLM;
worker 0 writes every bucket to OUT_DIR/r{INDEX}-v{version}-b{bucket}.bin, the others check they got the same bytes.
It stops once it holds WANT (or gives up after a while), writing OUT_DIR/r{INDEX}.json. DIE_IN = v: it joins round
v's group and exits without receiving (a member that dies mid-round).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from actors.weights.broadcast_source import BroadcastRound, BroadcastWeightsSource
from actors.weights.transfer import GroupTicket
from actors.weights.updates import WeightsRejected, WeightsTransportError
from common.broadcast import BroadcastError, BroadcastGroup, receive_round
from common.config import WeightsConfig
from common.sockets import PeerUnavailable, SocketSecurity
from common.weight_messages import WeightsHeader
from learners.broadcast_publisher import BroadcastWeightsPublisher

BUCKET_BYTES = 8192  # several buckets: the embedding alone spans more than one
RUN_S = 90.0  # every process gives up after this


def weights_config(group_port: int) -> WeightsConfig:
    return WeightsConfig(
        transport="broadcast",
        broadcast_backend="gloo",
        broadcast_port=group_port,
        broadcast_timeout_s=5.0,  # the dead member fails the round within it
        broadcast_join_timeout_s=10.0,
        broadcast_ready_timeout_s=2.0,  # a dead or late generator costs a round this much
    )


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


def run_publisher(doorbell: int, group: int, out: Path, versions: int, pause_s: float, heard: list[int]) -> None:
    publisher = BroadcastWeightsPublisher(
        "127.0.0.1", doorbell, SocketSecurity(), weights_config(group), bucket_bytes=BUCKET_BYTES
    )
    deadline = time.monotonic() + RUN_S
    for version in range(1, versions + 1):
        time.sleep(pause_s)
        expected = heard[version - 1] if version <= len(heard) else 0
        while len(publisher.generators_heard()) < expected and time.monotonic() < deadline:
            time.sleep(0.01)
        weights = member_weights(version)
        publisher.publish(version, layout_of(weights), iter(weights))
        while (
            time.monotonic() < deadline and publisher.counters["rounds"] + publisher.counters["failed_rounds"] < version
        ):
            time.sleep(0.01)
    outcome = {
        "counters": dict(publisher.counters),
        "bytes": publisher.bytes_by_version,
        "epoch_form_s": publisher.epoch_form_s,
    }
    time.sleep(1.0)  # receivers may still ask the doorbell once
    publisher.close()
    (out / "publisher.json").write_text(json.dumps(outcome))


class Receiver:
    """A generator's weights path without vLLM: its doorbell source and WORKERS group ranks (threads)."""

    def __init__(self, doorbell: int, group: int, out: Path, index: int, workers: int, die_in: int) -> None:
        self.source = BroadcastWeightsSource(
            f"127.0.0.1:{doorbell}", SocketSecurity(), index, workers, weights_config(group), request_timeout_s=10.0
        )
        self.out, self.index, self.workers, self.die_in = out, index, workers, die_in
        self.epoch, self.groups = -1, []
        self.errors: list[str] = []

    def take(self, update: BroadcastRound) -> bool:
        """Seal and receive one round; True when it was received whole by every worker."""
        try:
            ticket = self.source.seal(update.header)
        except WeightsRejected as error:
            self.errors.append(f"rejected: {error}")
            return False
        if ticket.epoch != self.epoch:
            self._join(ticket)
            if len(self.groups) != self.workers:
                self.errors.append(f"round v{update.policy_version}: could not join epoch {ticket.epoch}")
                self.epoch = -1
                return False
        if update.policy_version == self.die_in:
            os._exit(0)  # in the group, never receiving: the round must fail on the others, not hang
        received: list[list[bytes]] = [[] for _ in self.groups]
        threads = [
            threading.Thread(target=self._receive, args=(group, update.header, received[rank]))
            for rank, group in enumerate(self.groups)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if any(len(got) != len(update.header.bucket_sizes) for got in received):
            self.epoch = -1  # the group failed: the next round forms another
            return False
        assert all(got == received[0] for got in received), "workers received different bytes"
        for i, data in enumerate(received[0]):
            (self.out / f"r{self.index}-v{update.policy_version}-b{i}.bin").write_bytes(data)
        return True

    def _join(self, ticket: GroupTicket) -> None:
        for group in self.groups:
            group.close()
        groups: list[BroadcastGroup | None] = [None] * self.workers

        def open_rank(worker: int) -> None:
            rank = ticket.rank_offset + worker
            try:
                groups[worker] = BroadcastGroup.open(
                    ticket.host, ticket.port, rank, ticket.world_size, ticket.backend, ticket.timeout_s,
                    ticket.join_timeout_s,
                )  # fmt: skip
            except BroadcastError as error:
                self.errors.append(str(error))

        threads = [threading.Thread(target=open_rank, args=(w,)) for w in range(self.workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.groups, self.epoch = [g for g in groups if g is not None], ticket.epoch

    def _receive(self, group: BroadcastGroup, header: WeightsHeader, into: list[bytes]) -> None:
        try:
            receive_round(group, header, lambda i, bucket: into.append(bytes(bucket.numpy())))
        except BroadcastError as error:
            self.errors.append(f"round v{header.policy_version}: {error}")


def run_receiver(doorbell: int, group: int, out: Path, index: int, want: int, workers: int, die_in: int) -> None:
    receiver = Receiver(doorbell, group, out, index, workers, die_in)
    have, received = 0, []
    deadline = time.monotonic() + RUN_S
    while have < want and time.monotonic() < deadline:
        try:
            result = receiver.source.fetch(have)
        except (WeightsTransportError, PeerUnavailable) as error:
            receiver.errors.append(str(error))
            time.sleep(0.2)
            continue
        if isinstance(result, BroadcastRound):
            if receiver.take(result):
                have = result.policy_version
                received.append(have)
        else:
            time.sleep(0.05)
    outcome = {"have": have, "received": received, "errors": receiver.errors, "missed": receiver.source.missed_rounds}
    (out / f"r{index}.json").write_text(json.dumps(outcome))
    receiver.source.close()


if __name__ == "__main__":
    role, doorbell_port, group_port, out_dir = sys.argv[1:5]
    ports = (int(doorbell_port), int(group_port), Path(out_dir))
    if role == "publisher":
        pause_s = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
        heard = [int(count) for count in sys.argv[7].split(",")] if len(sys.argv) > 7 else []
        run_publisher(*ports, int(sys.argv[5]), pause_s, heard)
    else:
        index, want, workers = (int(a) for a in sys.argv[5:8])
        run_receiver(*ports, index, want, workers, int(sys.argv[8]) if len(sys.argv) > 8 else -1)
