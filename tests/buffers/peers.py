"""Fake generators and a fake learner that talk to a real buffer over real sockets (no vLLM, no DeepSpeed).

    python -m tests.buffers.peers hang ADDRESS GENERATOR_ID   # lease prompts, print "leased N", then hang

The thread versions retry every request until the buffer answers (through a buffer restart), like the real
roles do, and record what they saw so the tests can check that nothing was lost or served twice.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import numpy as np

from common.sockets import Client, PeerUnavailable, SocketSecurity
from common.types import (
    Batch,
    BatchNotReady,
    BatchRequest,
    ErrorReply,
    GroupAck,
    Heartbeat,
    LeaseGrant,
    LeaseRefused,
    LeaseRequest,
    Ok,
    StatsRequest,
    VersionReport,
)
from tests.buffers.fakes import make_group

SECURITY = SocketSecurity()


def call(client: Client, message: Any, deadline: float, timeout_s: float = 1.0) -> Any:
    """Send until answered (the buffer may be restarting); raises TimeoutError after `deadline` (monotonic)."""
    while time.monotonic() < deadline:
        try:
            reply, _ = client.request(message, timeout_s=timeout_s)
            return reply
        except PeerUnavailable:
            time.sleep(0.05)
    raise TimeoutError(f"no answer to {type(message).__name__} before the deadline")


def stats(address: str, timeout_s: float = 5.0) -> dict[str, int]:
    client = Client(address, SECURITY, identity="stats")
    try:
        return call(client, StatsRequest(), time.monotonic() + timeout_s).counters
    finally:
        client.close()


class Learner(threading.Thread):
    """Asks for the batch of each step, reporting step + 1 after each, until every one of `total_groups` groups
    was received, dropped by the buffer as too stale, or is left buffered, too few for a batch (it asks the
    buffer's stats whenever it must wait)."""

    def __init__(self, address: str, num_groups: int, total_groups: int, max_staleness: int, deadline: float) -> None:
        super().__init__(daemon=True)
        self.address, self.num_groups, self.total_groups = address, num_groups, total_groups
        self.max_staleness, self.deadline = max_staleness, deadline
        self.version = 0  # what the generators load as "published weights"
        self.groups: list[tuple[int, int, int]] = []  # (lease_id, prompt_id, epoch) in the order received
        self.max_seen_staleness = 0
        self.dropped = 0  # groups the buffer dropped as too stale (from its stats)
        self.left = 0  # groups left in the buffer at the end, fewer than a batch
        self.error: BaseException | None = None

    def run(self) -> None:
        client = Client(self.address, SECURITY, identity="learner", role="learner")
        try:
            step = 0
            while True:
                reply = call(client, BatchRequest(step, 0, 1, self.num_groups, 0.5), self.deadline, timeout_s=2.0)
                if isinstance(reply, BatchNotReady):
                    counters = call(client, StatsRequest(), self.deadline).counters
                    self.dropped, self.left = counters["dropped_stale_groups"], counters["buffered_groups"]
                    if len(self.groups) + self.dropped + self.left >= self.total_groups and self.left < self.num_groups:
                        return
                    continue
                assert isinstance(reply, Batch) and reply.step == step, reply
                for group, lag in zip(reply.groups, reply.staleness):
                    assert np.array_equal(lag, step - group.versions) and lag.max() <= self.max_staleness
                    self.max_seen_staleness = max(self.max_seen_staleness, int(lag.max()))
                    self.groups.append((group.lease_id, group.prompt_id, group.epoch))
                step += 1
                assert isinstance(call(client, VersionReport(step, step), self.deadline), Ok)
                self.version = step
        except BaseException as error:  # noqa: BLE001 - reported by the test thread
            self.error = error
        finally:
            client.close()


class Generator(threading.Thread):
    """Leases prompts at the learner's current version and pushes one synthetic group per prompt, until the
    buffer says "exhausted". Records every ack; `delay_s` paces it so a test can act mid-run."""

    def __init__(
        self, address: str, generator_id: int, learner: Learner, group_size: int, deadline: float, delay_s: float = 0.0
    ) -> None:
        super().__init__(daemon=True)
        self.address, self.generator_id, self.learner = address, generator_id, learner
        self.group_size, self.deadline, self.delay_s = group_size, deadline, delay_s
        self.acks: dict[str, list[tuple[int, int, int]]] = {"accepted": [], "duplicate": [], "rejected": []}
        self.refusals: dict[str, int] = {}
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        client = Client(self.address, SECURITY, identity=f"generator-{self.generator_id}", role="generator")
        try:
            while not self.stop.is_set():
                version = self.learner.version  # load the newest published weights before leasing
                reply = call(client, LeaseRequest(self.generator_id, 4, version), self.deadline)
                if isinstance(reply, LeaseRefused):
                    self.refusals[reply.reason] = self.refusals.get(reply.reason, 0) + 1
                    if reply.reason == "exhausted":
                        return
                    time.sleep(min(reply.retry_after_s, 0.1))
                    continue
                assert isinstance(reply, LeaseGrant), reply
                for prompt in reply.prompts:
                    time.sleep(self.delay_s)
                    group = make_group(reply.lease_id, prompt, self.generator_id, self.group_size, version)
                    ack = call(client, group, self.deadline)
                    assert isinstance(ack, GroupAck), ack
                    self.acks[ack.status].append((reply.lease_id, prompt.prompt_id, prompt.epoch))
                    call(client, Heartbeat(self.generator_id, version, [reply.lease_id]), self.deadline)
        except BaseException as error:  # noqa: BLE001 - re-raised by the test thread that joins this peer
            self.error = error
        finally:
            client.close()


def hang(address: str, generator_id: int) -> None:
    """Lease prompts, say so on stdout, then never send anything again (to be killed)."""
    client = Client(address, SECURITY, identity=f"hanging-{generator_id}", role="generator")
    reply = call(client, LeaseRequest(generator_id, 4, 0), time.monotonic() + 30)
    if isinstance(reply, ErrorReply):
        raise SystemExit(reply.reason)
    print(f"leased {len(reply.prompts) if isinstance(reply, LeaseGrant) else 0}", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    if sys.argv[1] == "hang":
        hang(sys.argv[2], int(sys.argv[3]))
