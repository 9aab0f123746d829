"""Weights by collective broadcast (`weights.transport = "broadcast"`), the generator's side: a `WeightsSource`.

    source = open_broadcast_source(config.weights, weights_address, security, generator_id)
    poller = WeightsPoller(source, poll_s, backoff_max_s)            # as with any source (actors/weights.py)

`fetch(have_version)` asks the publisher's doorbell (`learners/broadcast_publisher.py`) over ZeroMQ. `WeightsNotNewer`
returns its version; a `WeightsHeader(transport="broadcast")` announces the round in flight, and the source then
takes part in it (`common.broadcast.receive_round`), receiving every bucket into its own buffers.

Generator i is rank i + 1 of a group of `weights.broadcast_fleet_size` + 1, fixed at start: the first fetch joins
it (waiting up to `broadcast_join_timeout_s` for the whole fleet). No generator joins later or replaces a dead one.

Buffers: one bucket set, reused while the layout stays. With gloo the update's `buckets` are views of it (host
memory), valid until the next `fetch`; the generator loads an update before it fetches again (WeightsPoller's loop).
With nccl the buckets are on this process's GPU: the update is a `DeviceWeightsUpdate` (actors/cuda_weights.py),
whose tensors the engine hands to its workers by CUDA IPC (built for CUDA, never run on a GPU).

Failure modes, all `WeightsTransportError` (the poller counts them and retries after its back-off; the generator
keeps sampling with the weights it has): the doorbell refused (`ErrorReply`: also when the publisher's group
failed), a header another transport announced or that `check_frames` refuses, a layout that changed, a group that
did not form or a round that failed (a member died or stalled: within `broadcast_timeout_s`). A group that failed
stays failed: every later fetch says so at once.
"""

from __future__ import annotations

import time
from typing import Any

from actors.weights import LayoutGuard, WeightsTransportError, WeightsUpdate, ask_publisher
from common.broadcast import BroadcastError, BroadcastGroup, allocate_buckets, check_header, receive_round
from common.config import WeightsConfig
from common.sockets import Client, SocketSecurity
from common.types import WeightsHeader, WeightsRequest
from common.weights import WeightsLayoutError


class BroadcastWeightsSource:
    """Rank `generator_id + 1` of the static broadcast group (see the module docstring). One thread at a time."""

    def __init__(
        self,
        address: str,
        security: SocketSecurity,
        generator_id: int,
        group_address: tuple[str, int],
        fleet_size: int,
        backend: str,
        timeout_s: float,
        join_timeout_s: float,
        request_timeout_s: float = 120.0,
    ) -> None:
        if not 0 <= generator_id < fleet_size:
            raise ValueError(
                f"generator {generator_id} is outside the broadcast group of weights.broadcast_fleet_size = "
                f"{fleet_size} generators (indices 0..{fleet_size - 1}): the group is fixed at start, so a replaced "
                "or added generator cannot join; use weights.transport = 'relay' for a fleet that changes"
            )
        self.client = Client(address, security, identity=f"generator-{generator_id}-weights", role="generator")
        self.generator_id = generator_id
        self.request_timeout_s = request_timeout_s
        self._group_args = (*group_address, generator_id + 1, fleet_size + 1, backend, timeout_s, join_timeout_s)
        self._insecure = security.insecure
        self.group: BroadcastGroup | None = None
        self.layout = LayoutGuard()
        self._buckets: list[Any] = []

    def fetch(self, have_version: int) -> WeightsUpdate | int:
        group = self._joined()
        request = WeightsRequest(generator_id=self.generator_id, have_version=have_version)
        answer = ask_publisher(self.client, request, self.request_timeout_s, ("broadcast",), "the weights doorbell")
        if isinstance(answer, int):
            return answer
        reply = answer[0]
        self._check(reply)
        buckets = self._buckets_for(reply, group)
        try:
            receive_round(group, reply, buckets)
        except BroadcastError as error:
            raise WeightsTransportError(str(error)) from None
        if group.backend == "nccl":
            from actors.cuda_weights import DeviceWeightsUpdate

            return DeviceWeightsUpdate(reply, [], received_at=time.monotonic(), device_buckets=list(buckets))
        return WeightsUpdate(reply, [memoryview(b.numpy()) for b in buckets], received_at=time.monotonic())

    def _joined(self) -> BroadcastGroup:
        if self.group is None:
            try:
                self.group = BroadcastGroup.open(*self._group_args, insecure=self._insecure)
            except BroadcastError as error:
                raise WeightsTransportError(str(error)) from None
        if self.group.broken:
            raise WeightsTransportError(f"the weights broadcast group failed ({self.group.broken}): restart the fleet")
        return self.group

    def _check(self, header: WeightsHeader) -> None:
        try:
            check_header(header)
        except WeightsLayoutError as error:
            raise WeightsTransportError(f"malformed weights header: {error}") from None
        self.layout.check(header)

    def _buckets_for(self, header: WeightsHeader, group: BroadcastGroup) -> list[Any]:
        if [b.numel() for b in self._buckets] != list(header.bucket_sizes):
            self._buckets = allocate_buckets(header.bucket_sizes, group.device)
        return self._buckets

    def close(self) -> None:
        self.client.close()
        if self.group is not None:
            self.group.close()


def open_broadcast_source(
    weights: WeightsConfig, address: str, security: SocketSecurity, generator_id: int
) -> BroadcastWeightsSource:
    """The source for `weights.transport = "broadcast"` (doorbell at `address`, group at weights.broadcast_*).
    Raises ValueError for a configuration that cannot work (generator index outside the fixed fleet, nccl without
    CUDA, an exposed group address without run.insecure)."""
    from common.broadcast import refuse_exposed_group, resolve_backend

    resolve_backend(weights.broadcast_backend)
    refuse_exposed_group(weights.broadcast_host, security.insecure)
    return BroadcastWeightsSource(
        address,
        security,
        generator_id,
        (weights.broadcast_host, weights.broadcast_port),
        weights.broadcast_fleet_size,
        weights.broadcast_backend,
        weights.broadcast_timeout_s,
        weights.broadcast_join_timeout_s,
    )
