"""Weights by collective broadcast to a static fleet (`weights.transport = "broadcast"`), learner rank 0's side.

    publisher = open_broadcast_publisher(config.weights, host, port, security)   # doorbell bound; group forms
    seconds = publisher.publish(version, trainer.weight_layout(), trainer.full_weights())
    publisher.close()

Two channels (the generator's side is `actors/broadcast_source.py`):
  * the doorbell, a ZeroMQ ROUTER on the publisher's usual host:port (CURVE and roles as in
    `learners/publisher.py`): a `WeightsRequest(have_version)` is answered with the header of the round in flight,
    `WeightsHeader(transport="broadcast")` with no payload, when its version is newer, else `WeightsNotNewer`;
  * the group (`common/broadcast.py`): rank 0 here, generator i rank i + 1; the buckets travel there, once per
    update whatever the fleet size.

Ordering: `publish` copies the weights into a bucket set (on the group's device: the GPU for nccl, host memory for
gloo) and hands it to the round thread; the training loop is blocked for that copy only. The round thread sends one
round at a time, always the newest update (an update superseded before its round started is skipped, counted
`superseded`). The doorbell advertises a round's header from the moment the round starts until the next one starts,
so a generator told "newer" always meets that very round in the group (the round cannot finish without it).
Two bucket sets at most: the one being sent and the one being written.

The group is fixed at start (`weights.broadcast_fleet_size` generators; no elastic joins: use the relay transport
for a fleet that changes). It forms in the round thread, waiting up to `broadcast_join_timeout_s`; updates published
meanwhile wait (the newest is sent first). When a member dies or stalls, the round fails within
`broadcast_timeout_s`, the group is broken for good, the doorbell refuses every request with the reason (generators
count it and keep sampling with the weights they have), and the next `publish` raises `BroadcastError`, naming the
fix. Nothing waits forever.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from common.broadcast import (
    BroadcastError,
    BroadcastGroup,
    allocate_buckets,
    copy_into_buckets,
    resolve_backend,
    send_round,
)
from common.config import WeightsConfig
from common.serving import answer_safely, supervised_thread
from common.sockets import Request, Server, SocketSecurity
from common.types import WeightsHeader, WeightsNotNewer, WeightsRequest
from common.weights import DEFAULT_BUCKET_MB, plan_buckets
from learners.publisher import WEIGHTS_READERS, Layout

log = logging.getLogger("tandem.learner.broadcast")


@dataclass
class _Round:
    header: WeightsHeader  # transport "broadcast"
    buckets: list[Any]  # uint8 tensors on the group's device


class BroadcastWeightsPublisher:
    """Rank 0 of the broadcast group plus its ZeroMQ doorbell (see the module docstring). Counters: `published`,
    `rounds`, `superseded`, `served_bytes` (bytes this rank broadcast), `bytes_by_version[v]`, `not_newer`,
    `announced`, `rejected/*`. Raises OSError from the constructor when the doorbell's port cannot be bound."""

    def __init__(
        self,
        host: str,
        port: int,
        security: SocketSecurity,
        group_address: tuple[str, int],
        fleet_size: int,
        backend: str,
        timeout_s: float,
        join_timeout_s: float,
        bucket_bytes: int = int(DEFAULT_BUCKET_MB * (1 << 20)),
        poll_ms: int = 20,
    ) -> None:
        if fleet_size < 1:
            raise ValueError(
                "weights.transport 'broadcast' needs weights.broadcast_fleet_size >= 1: the number of generators, "
                "fixed at start"
            )
        self.bucket_bytes = bucket_bytes
        self.device = _bucket_device(resolve_backend(backend))  # where the buckets live: the group's device
        self.counters: Counter[str] = Counter()
        self.bytes_by_version: dict[int, int] = {}
        self.failure = ""  # why the group failed ("" while it works)
        self._lock = threading.Condition()
        self._pending: _Round | None = None  # the newest update, not yet sent
        self._spare: list[list[Any]] = []  # a bucket set no round uses
        self._announced: WeightsHeader | None = None  # the round in flight, or the last one sent
        self._stop = threading.Event()
        self._group: BroadcastGroup | None = None
        self._server = Server(host, port, security, "weights doorbell (broadcast)")  # binds now: OSError here
        group_args = (*group_address, fleet_size + 1, backend, timeout_s, join_timeout_s, security.insecure)
        self._threads = [
            supervised_thread(lambda: self._serve_doorbell(poll_ms), "weights-doorbell", self._stop),  # restarted
            threading.Thread(target=self._send_rounds, args=group_args, name="weights-broadcast", daemon=True),
        ]
        self._threads[1].start()

    def publish(self, version: int, layout: Layout, weights: Iterable[tuple[str, Any]]) -> float:
        """Copy `weights` (in `layout` order) into a bucket set and queue it as the next round; returns the seconds
        it blocked. Raises BroadcastError once the group has failed, ValueError for weights that are not `layout`."""
        start = time.perf_counter()
        if self.failure:
            raise BroadcastError(
                f"the weights broadcast group failed ({self.failure}): generators get no more updates. Restart the "
                "run with every generator up, or use weights.transport = 'relay' for a fleet that changes"
            )
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
        _synchronize(buckets)
        header = WeightsHeader(policy_version=version, tensors=specs, bucket_sizes=sizes, transport="broadcast")
        with self._lock:
            self._pending = _Round(header, buckets)
            self._lock.notify_all()
        self.counters["published"] += 1
        return time.perf_counter() - start

    def _send_rounds(
        self, host: str, port: int, world: int, backend: str, timeout_s: float, join_s: float, insecure: bool
    ) -> None:
        """Round thread: form the group (rank 0), then send the newest pending update, one round at a time."""
        try:
            self._group = BroadcastGroup.open(host, port, 0, world, backend, timeout_s, join_s, insecure)
            log.info("weights broadcast group formed: %d generators, %s", world - 1, self._group.backend)
            while not self._stop.is_set():
                pending = self._next_round()
                if pending is None:
                    continue
                sent = send_round(self._group, pending.header.policy_version, pending.buckets)
                with self._lock:
                    self._spare.append(pending.buckets)
                self.counters["rounds"] += 1
                self.counters["served_bytes"] += sent
                self.bytes_by_version[pending.header.policy_version] = sent
        except (BroadcastError, ValueError) as error:
            self.failure = str(error)
            self.counters["failed"] += 1
            log.error("weights broadcast stopped: %s", error)

    def _next_round(self) -> _Round | None:
        with self._lock:
            if self._pending is None:
                self._lock.wait(timeout=0.1)
            pending, self._pending = self._pending, None
            if pending is not None:
                self._announced = pending.header
        return pending

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
        if self.failure:
            self._server.reject(request, f"the weights broadcast group failed: {self.failure}", "broadcast_failed")
            return
        with self._lock:
            announced = self._announced
        if announced is None or announced.policy_version <= message.have_version:
            latest = -1 if announced is None else announced.policy_version
            self._server.reply(request, WeightsNotNewer(latest_version=latest))
            self.counters["not_newer"] += 1
            return
        self._server.reply(request, announced)
        self.counters["announced"] += 1

    def close(self) -> None:
        """Stop both threads; a round in flight ends within `broadcast_timeout_s` (its thread is a daemon)."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
        self.counters.update({f"rejected/{k}": v for k, v in self._server.rejected.items()})
        self._server.close()
        if self._group is not None and not self._threads[1].is_alive():
            self._group.close()


def _bucket_device(backend: str) -> Any:
    """nccl broadcasts from this rank's GPU; gloo from host memory (a CUDA learner's weights are copied down once,
    in `publish`)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _synchronize(buckets: list[Any]) -> None:
    """Wait for copies queued on the GPU (`copy_into_buckets` is non-blocking) before another thread reads them."""
    if buckets and buckets[0].device.type == "cuda":
        import torch

        torch.cuda.synchronize(buckets[0].device)


def open_broadcast_publisher(
    weights: WeightsConfig, host: str, port: int, security: SocketSecurity
) -> BroadcastWeightsPublisher:
    """The publisher for `weights.transport = "broadcast"` (doorbell on host:port, group on weights.broadcast_*).
    Raises ValueError for a configuration that cannot work (no fleet size, nccl without CUDA, an exposed group
    address without run.insecure), OSError when the doorbell's port is taken."""
    from common.broadcast import refuse_exposed_group

    refuse_exposed_group(weights.broadcast_host, security.insecure)
    return BroadcastWeightsPublisher(
        host,
        port,
        security,
        (weights.broadcast_host, weights.broadcast_port),
        weights.broadcast_fleet_size,
        weights.broadcast_backend,
        weights.broadcast_timeout_s,
        weights.broadcast_join_timeout_s,
    )
