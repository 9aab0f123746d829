"""Weights by collective broadcast to an elastic fleet (`weights.transport = "broadcast"`), learner rank 0's side.

    publisher = open_broadcast_publisher(config.weights, host, port, security)   # doorbell bound
    seconds = publisher.publish(version, trainer.weight_layout(), trainer.full_weights())
    publisher.close()

Two channels (the generator's side is `actors/weights/broadcast_source.py`, its vLLM workers `actors/weights/transfer.py`):
  * the doorbell, a ZeroMQ ROUTER on the publisher's usual host:port (CURVE and roles as in
    `learners/publisher.py`): every `WeightsRequest` says which generator asks, how many workers it has and which
    round it is ready for; the answer is the header of the round in flight (no payload) when it is newer than the
    generator's, else `WeightsNotNewer`;
  * the group (`common/broadcast.py`): this rank is rank 0; the buckets travel there, once per update whatever
    the fleet size.

A round is two-phase, on the round thread, never on the training thread:
  1. announce: `publish` copies the weights into a bucket set (on the group's device: this rank's GPU for nccl,
     host memory for gloo) and hands it over; the training loop is blocked for that copy only. The round thread
     takes the newest update (an update superseded before its round started is skipped, counted `superseded`) and
     the doorbell announces it.
  2. seal: the thread waits until every generator heard from in the last `member_timeout_s` said it is ready
     (it can receive at once), at most `broadcast_ready_timeout_s`; those ready are the round's members, the late
     ones take the next round (counted `late_members`). Then the members' group is formed if it is not the last
     round's (a new "epoch": a generator joined, died, or was late; `epochs`, `epoch_form_s`), and the round is
     sent (`rounds`).
A member that dies during a round fails that round within `broadcast_timeout_s` (`failed_rounds`); the group is
closed and the next round forms a new one without it. Nothing here is fatal to the fleet, and training never waits
for a generator: on a GPU the broadcast runs on its own CUDA stream, and `publish` waits only for its own copies.

Ports: epoch 0's group meets at `weights.broadcast_port`; later epochs at a free port of `broadcast_host` chosen
by this rank (a firewall between hosts must let the learner's ephemeral ports through, or keep one epoch).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from common.broadcast import (
    BroadcastGroup,
    allocate_buckets,
    copy_into_buckets,
    refuse_exposed_group,
    resolve_backend,
    send_round,
)
from common.config import WeightsConfig
from common.serving import answer_safely, supervised_thread
from common.sockets import Request, Server, SocketSecurity, free_port
from common.weight_messages import WeightsHeader, WeightsNotNewer, WeightsRequest
from common.weights import DEFAULT_BUCKET_MB, plan_buckets
from learners.publisher import WEIGHTS_READERS
from learners.snapshot import Layout

log = logging.getLogger("tandem.learner.broadcast")

MIN_MEMBER_TIMEOUT_S = 60.0  # a generator silent for longer is not waited for (it died, or holds a long drain)


@dataclass
class _Member:
    workers: int  # its vLLM workers: group ranks
    seen: float  # monotonic time of its last doorbell request
    ready: int = -1  # the round version it said it can receive at once


@dataclass
class _Round:
    header: WeightsHeader  # transport "broadcast"; group fields set once sealed
    buckets: list[Any]  # uint8 tensors on the group's device
    ranks: dict[int, int] = field(default_factory=dict)  # generator id -> its first rank, once sealed
    done: bool = False  # sent or failed: nobody joins it any more


@dataclass
class _Epoch:
    number: int
    members: tuple[tuple[int, int], ...]  # (generator id, workers), in rank order
    group: BroadcastGroup
    port: int


class BroadcastWeightsPublisher:
    """Rank 0 of the broadcast group plus its ZeroMQ doorbell (see the module docstring). Counters: `published`,
    `rounds`, `superseded`, `failed_rounds`, `late_members`, `epochs`, `served_bytes` (bytes this rank broadcast),
    `bytes_by_version[v]`, `not_newer`, `announced`, `rejected/*`; `epoch_form_s`: seconds each group took to
    form. Raises OSError from the constructor when the doorbell's port cannot be bound."""

    def __init__(
        self,
        host: str,
        port: int,
        security: SocketSecurity,
        weights: WeightsConfig,
        bucket_bytes: int = int(DEFAULT_BUCKET_MB * (1 << 20)),
        poll_ms: int = 20,
    ) -> None:
        import torch

        self.weights = weights
        self.insecure = security.insecure
        self.bucket_bytes = bucket_bytes
        self.backend = resolve_backend(weights.broadcast_backend)
        cuda = self.backend == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.member_timeout_s = max(MIN_MEMBER_TIMEOUT_S, 2 * weights.broadcast_ready_timeout_s)
        self.counters: Counter[str] = Counter()
        self.bytes_by_version: dict[int, int] = {}
        self.epoch_form_s: list[float] = []
        self._lock = threading.Condition()
        self._pending: _Round | None = None  # the newest update, not yet announced
        self._spare: list[list[Any]] = []  # a bucket set no round uses
        self._round: _Round | None = None  # the round announced (in flight, or the last one)
        self._roster: dict[int, _Member] = {}
        self._epoch: _Epoch | None = None
        self._epochs = 0
        self._stop = threading.Event()
        self._server = Server(host, port, security, "weights doorbell (broadcast)")  # binds now: OSError here
        self._threads = [
            supervised_thread(lambda: self._serve_doorbell(poll_ms), "weights-doorbell", self._stop),  # restarted
            threading.Thread(target=self._send_rounds, name="weights-broadcast", daemon=True),
        ]
        self._threads[1].start()

    # ------------------------------------------------------------------------------------------ training thread
    def publish(self, version: int, layout: Layout, weights: Iterable[tuple[str, Any]]) -> float:
        """Copy `weights` (in `layout` order) into a bucket set and queue it as the next round; returns the seconds
        it blocked. Raises ValueError for weights that are not `layout`."""
        start = time.perf_counter()
        specs, sizes = plan_buckets(list(layout), self.bucket_bytes)
        with self._lock:
            superseded, self._pending = self._pending, None
            if superseded is not None:
                self.counters["superseded"] += 1
                self._spare.append(superseded.buckets)
            buckets = next((b for b in self._spare if [t.numel() for t in b] == sizes), None)
            self._spare = [b for b in self._spare if b is not buckets]
        if buckets is None:
            buckets = allocate_buckets(sizes, self.device)
        copy_into_buckets(specs, weights, buckets)
        if self.device.type == "cuda":  # the copies were queued on this thread's stream: wait for them only
            import torch

            torch.cuda.current_stream(self.device).synchronize()
        header = WeightsHeader(policy_version=version, tensors=specs, bucket_sizes=sizes, transport="broadcast")
        with self._lock:
            self._pending = _Round(header, buckets)
            self._lock.notify_all()
        self.counters["published"] += 1
        return time.perf_counter() - start

    # -------------------------------------------------------------------------------------------- round thread
    def _send_rounds(self) -> None:
        """Announce, seal and send the newest update, one round at a time (see the module docstring)."""
        stream = None
        if self.device.type == "cuda":  # this thread's device is cuda:0 until told (review finding 16)
            import torch

            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(self.device)  # off the training stream
        while not self._stop.is_set():
            current = self._announce_next()
            if current is None:
                continue
            members = self._wait_until_ready(current)
            if not members:
                continue  # stopped, or a newer update replaced this one before anyone was ready
            try:
                self._send(current, members, stream)
            except Exception as error:  # noqa: BLE001 - any fault ends this round, never the thread (finding 16)
                self._fail(current, error)
            finally:
                with self._lock:
                    current.done = True
                    self._spare.append(current.buckets)

    def _announce_next(self) -> _Round | None:
        with self._lock:
            if self._pending is None:
                self._lock.wait(timeout=0.1)
            pending, self._pending = self._pending, None
            if pending is not None:
                self._round = pending
        return pending

    def _wait_until_ready(self, current: _Round) -> list[tuple[int, int]]:
        """The round's members, (generator id, workers) by id: every recently heard generator once all are ready,
        or those ready when broadcast_ready_timeout_s has passed since the announcement. Empty when the thread
        stops, or a newer update arrived before any generator was ready (it is announced instead)."""
        version = current.header.policy_version
        deadline = time.monotonic() + self.weights.broadcast_ready_timeout_s
        with self._lock:
            while not self._stop.is_set():
                now = time.monotonic()
                heard = self._heard(now)
                ready = [(g, m.workers) for g, m in sorted(heard.items()) if m.ready == version]
                if ready and (len(ready) == len(heard) or now >= deadline):
                    self.counters["late_members"] += len(heard) - len(ready)
                    return ready
                if not ready and self._pending is not None:
                    self._spare.append(current.buckets)
                    current.done = True
                    return []
                self._lock.wait(timeout=0.05)
        return []

    def _heard(self, now: float) -> dict[int, _Member]:
        """The generators that asked the doorbell within member_timeout_s (under the lock)."""
        return {g: m for g, m in self._roster.items() if now - m.seen <= self.member_timeout_s}

    def generators_heard(self) -> list[int]:
        """The ids of the generators heard recently: a round announced now waits for each of them to be ready."""
        with self._lock:
            return sorted(self._heard(time.monotonic()))

    def _send(self, current: _Round, members: list[tuple[int, int]], stream: Any) -> None:
        epoch = self._epoch if self._epoch is not None and self._epoch.members == tuple(members) else None
        if epoch is not None:
            number, port = epoch.number, epoch.port
        else:
            number = self._epochs
            port = self.weights.broadcast_port if number == 0 else free_port(self.weights.broadcast_host)
        ranks, rank = {}, 1
        for generator_id, workers in members:
            ranks[generator_id], rank = rank, rank + workers
        header = replace(current.header, group_epoch=number, group_port=port, group_size=rank, group_rank=-1)
        with self._lock:  # sealed: the members' next doorbell request gets their ranks
            current.header, current.ranks = header, ranks
            self._lock.notify_all()
        if epoch is None:
            epoch = self._form_epoch(number, port, rank, tuple(members))
        sent = send_round(epoch.group, header.policy_version, current.buckets, stream)
        self.counters["rounds"] += 1
        self.counters["served_bytes"] += sent
        self.bytes_by_version[header.policy_version] = sent

    def _form_epoch(self, number: int, port: int, size: int, members: tuple[tuple[int, int], ...]) -> _Epoch:
        if self._epoch is not None:
            self._epoch.group.close()
            self._epoch = None
        self._epochs = number + 1
        started = time.monotonic()
        group = BroadcastGroup.open(
            self.weights.broadcast_host,
            port,
            0,
            size,
            self.backend,
            self.weights.broadcast_timeout_s,
            self.weights.broadcast_join_timeout_s,
            self.insecure,
            device=self.device,
        )
        self.epoch_form_s.append(time.monotonic() - started)
        self.counters["epochs"] += 1
        self._epoch = _Epoch(number, members, group, port)
        log.info(
            "weights group epoch %d formed in %.2fs: generators %s, %d ranks (%s)",
            number,
            self.epoch_form_s[-1],
            [g for g, _ in members],
            size,
            self.backend,
        )
        return self._epoch

    def _fail(self, current: _Round, error: Exception) -> None:
        """A round that failed (a member died or stalled, or its group did not form): counted and logged; the group
        is closed, and the next round forms a new one with the generators then ready."""
        self.counters["failed_rounds"] += 1
        if self._epoch is not None:
            self._epoch.group.close()
            self._epoch = None
        log.warning(
            "weights round v%d failed: %s; the next round forms a new group", current.header.policy_version, error
        )

    # ------------------------------------------------------------------------------------------------ doorbell
    @property
    def rejected(self) -> dict[str, int]:
        """Doorbell requests refused so far, by kind (`common.sockets.Server.rejected`)."""
        return dict(self._server.rejected)

    def _serve_doorbell(self, poll_ms: int) -> None:
        while not self._stop.is_set():
            request = self._server.poll(poll_ms)
            if request is not None:  # a fault while answering it: a rejected request (common.serving)
                answer_safely(self._server, request, self._answer)

    def _answer(self, request: Request) -> None:
        message = request.message
        if not isinstance(message, WeightsRequest):
            reason = f"the weights doorbell answers weights_request only, not {type(message).WIRE_NAME}"
            self._server.reject(request, reason, "unexpected_type")
            return
        if request.role not in WEIGHTS_READERS:
            reason = (
                f"a peer of role '{request.role or 'none'}' may not fetch weights (only {', '.join(WEIGHTS_READERS)})"
            )
            self._server.reject(request, reason, "forbidden_role")
            return
        with self._lock:
            member = self._roster.setdefault(message.generator_id, _Member(message.group_workers, 0.0))
            member.workers, member.seen = message.group_workers, time.monotonic()
            if message.ready_version >= 0:
                member.ready = message.ready_version
                self._lock.notify_all()
            current = self._round
            header = None if current is None else self._header_for(current, message.generator_id)
        if header is None or header.policy_version <= message.have_version:
            latest = -1 if header is None else header.policy_version
            self._server.reply(request, WeightsNotNewer(latest_version=latest))
            self.counters["not_newer"] += 1
            return
        self._server.reply(request, header)
        self.counters["announced"] += 1

    @staticmethod
    def _header_for(current: _Round, generator_id: int) -> WeightsHeader:
        """The round's header as `generator_id` sees it: its first rank once sealed (-1 outside the round, and for
        everyone once the round is over)."""
        if current.header.group_epoch < 0:
            return current.header
        rank = -1 if current.done else current.ranks.get(generator_id, -1)
        return replace(current.header, group_rank=rank)

    def close(self) -> None:
        """Stop both threads; a round in flight ends within `broadcast_timeout_s` (its thread is a daemon)."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
        self.counters.update({f"rejected/{k}": v for k, v in self._server.rejected.items()})
        self._server.close()
        if self._epoch is not None and not self._threads[1].is_alive():
            self._epoch.group.close()


def open_broadcast_publisher(
    weights: WeightsConfig, host: str, port: int, security: SocketSecurity
) -> BroadcastWeightsPublisher:
    """The publisher for `weights.transport = "broadcast"` (doorbell on host:port, group on weights.broadcast_*).
    Raises ValueError for a configuration that cannot work (nccl without CUDA, an exposed group address without
    run.insecure), OSError when the doorbell's port is taken."""
    refuse_exposed_group(weights.broadcast_host, security.insecure)
    return BroadcastWeightsPublisher(host, port, security, weights)
