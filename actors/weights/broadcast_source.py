"""Weights by collective broadcast (`weights.transport = "broadcast"`), the generator's side: a `WeightsSource`.

    source = open_broadcast_source(config.weights, weights_address, security, generator_id, workers=tp_size)
    poller = WeightsPoller(source, poll_s, backoff_max_s)            # as with any source (actors/weights/updates.py)
    update = poller.poll(...)                                        # a BroadcastRound: announced, no payload
    ticket = update.source.seal(update.header)                       # at the load point: ready -> the round's group
    engine.load_weights(update, ...)                                 # VllmEngine does the two lines above itself

A round is two-phase (learners/broadcast_publisher.py):
  1. `fetch(have_version)` asks the doorbell; a newer round comes back as its header, announced but not sealed.
     The fetch returns it as a `BroadcastRound` (no payload: the weights never pass through this process).
  2. When the generator can take the round at once (its load point: drained, or between two steps in in-flight
     mode), `seal` says so (`WeightsRequest.ready_version`) and waits for the publisher to seal the round: every
     generator it heard from is ready, or `broadcast_ready_timeout_s` passed and the late ones are left out. The
     sealed header names the group (epoch, port, size) and this generator's first rank; its vLLM workers then join
     that group if the epoch is new and receive the round (`actors.weights.transfer`, through vLLM's
     weight-transfer API).
A generator left out of a round (ready too late, or it joined the fleet after the round was sealed) keeps its
weights and takes the next round; so does one whose round failed. Nothing here waits without a bound.

Failure modes, all `WeightsTransportError` from `fetch` (the poller counts them and retries after its back-off;
the generator keeps sampling with the weights it has): the doorbell refused (`ErrorReply`), a header another
transport announced or that `check_frames` refuses, a layout that changed. `seal` raises `WeightsRejected` (counted
the same way) when the round went without this generator, was superseded, or was not sealed in time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from actors.weights.transfer import GroupTicket
from actors.weights.updates import LayoutGuard, WeightsRejected, WeightsTransportError, WeightsUpdate, ask_publisher
from common.broadcast import check_header, refuse_exposed_group, resolve_backend
from common.config import WeightsConfig
from common.sockets import Client, SocketSecurity
from common.weight_messages import WeightsHeader, WeightsRequest
from common.weights import WeightsLayoutError

SEAL_POLL_S = 0.02  # how often a ready generator asks whether its round is sealed


@dataclass
class BroadcastRound(WeightsUpdate):
    """An announced broadcast round: `header` only (no buckets); `source.seal(header)` gives its group ticket."""

    source: Any = None  # the BroadcastWeightsSource that fetched it


class BroadcastWeightsSource:
    """A generator's doorbell client for the broadcast transport (see the module docstring). `fetch` runs on the
    poller's thread, `seal` on the generator's loop: one at a time each. Counters: `missed_rounds` (sealed
    without this generator), `superseded`."""

    def __init__(
        self,
        address: str,
        security: SocketSecurity,
        generator_id: int,
        workers: int,
        weights: WeightsConfig,
        request_timeout_s: float = 120.0,
    ) -> None:
        self.client = Client(address, security, identity=f"generator-{generator_id}-weights", role="generator")
        self.generator_id = generator_id
        self.workers = workers
        self.weights = weights
        self.insecure = security.insecure
        self.request_timeout_s = request_timeout_s
        self.layout = LayoutGuard()
        self.missed_rounds = 0
        self.superseded = 0
        self.sealed_version = -1  # the last round sealed for this generator: taking part once is all it gets

    def fetch(self, have_version: int) -> WeightsUpdate | int:
        answer = self._ask(have_version, ready_version=-1)
        if isinstance(answer, int):
            return answer
        # sealed without us, or a round we took part in already (it failed: its group is gone): the next is ours
        if answer.group_epoch >= 0 and (answer.group_rank < 0 or answer.policy_version <= self.sealed_version):
            self.missed_rounds += 1
            return have_version
        return BroadcastRound(answer, [], received_at=time.monotonic(), source=self)

    def seal(self, header: WeightsHeader) -> GroupTicket:
        """Say this generator can receive `header`'s round now and wait until the publisher seals it; returns
        where this generator's workers take part. Raises `WeightsRejected` when the round went without it, a newer
        one replaced it, or it was not sealed within broadcast_ready_timeout_s (+ a request's timeout)."""
        version = header.policy_version
        deadline = time.monotonic() + self.weights.broadcast_ready_timeout_s + self.request_timeout_s
        while time.monotonic() < deadline:
            answer = self._ask(version - 1, ready_version=version)
            if isinstance(answer, int) or answer.policy_version != version:
                self.superseded += 1
                latest = answer if isinstance(answer, int) else answer.policy_version
                raise WeightsRejected(f"broadcast round v{version} was replaced (the publisher announces v{latest})")
            if answer.group_epoch >= 0:
                self.sealed_version = version
                return self._ticket(answer)
            time.sleep(SEAL_POLL_S)
        raise WeightsRejected(f"broadcast round v{version} was not sealed in time: is the publisher alive?")

    def _ticket(self, header: WeightsHeader) -> GroupTicket:
        if header.group_rank < 0:
            self.missed_rounds += 1
            raise WeightsRejected(
                f"broadcast round v{header.policy_version} was sealed without this generator (ready after "
                f"weights.broadcast_ready_timeout_s = {self.weights.broadcast_ready_timeout_s:g}s): it takes the next"
            )
        return GroupTicket(
            epoch=header.group_epoch,
            host=self.weights.broadcast_host,
            port=header.group_port,
            world_size=header.group_size,
            rank_offset=header.group_rank,
            backend=self.weights.broadcast_backend,
            timeout_s=self.weights.broadcast_timeout_s,
            join_timeout_s=self.weights.broadcast_join_timeout_s,
            insecure=self.insecure,
        )

    def _ask(self, have_version: int, ready_version: int) -> WeightsHeader | int:
        request = WeightsRequest(
            generator_id=self.generator_id,
            have_version=have_version,
            ready_version=ready_version,
            group_workers=self.workers,
        )
        answer = ask_publisher(self.client, request, self.request_timeout_s, ("broadcast",), "the weights doorbell")
        if isinstance(answer, int):
            return answer
        header = answer[0]
        try:
            check_header(header)
        except WeightsLayoutError as error:
            raise WeightsTransportError(f"malformed weights header: {error}") from None
        self.layout.check(header)
        return header

    def close(self) -> None:
        self.client.close()


def open_broadcast_source(
    weights: WeightsConfig, address: str, security: SocketSecurity, generator_id: int, workers: int = 1
) -> BroadcastWeightsSource:
    """The source for `weights.transport = "broadcast"` (doorbell at `address`, group at weights.broadcast_host).
    `workers`: the engine's vLLM workers (generator.tensor_parallel_size), one group rank each. Raises ValueError
    for a configuration that cannot work (nccl without CUDA, an exposed group address without run.insecure)."""
    resolve_backend(weights.broadcast_backend)
    refuse_exposed_group(weights.broadcast_host, security.insecure)
    return BroadcastWeightsSource(address, security, generator_id, workers, weights)
