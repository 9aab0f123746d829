"""`[weights]`: how published weights reach the generators (relay, star, broadcast)."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
)

from common.config.base import MAX_TIMEOUT_S, Host, _Section


class WeightsConfig(_Section):
    """How new weights travel from learner rank 0 to the generators (learners/publisher.py, actors/weights/updates.py)."""

    transport: Literal["relay", "star", "broadcast"] = Field(
        "relay",
        description="relay: the publisher feeds `fanout` generators and every other generator pulls each chunk from "
        "a parent generator as it arrives (the publisher's bytes stay flat as the fleet grows); star: every "
        "generator pulls the whole update from the publisher; broadcast: a collective group (NCCL on GPUs, gloo on "
        "CPU) of the generators ready for each round, received inside vLLM's workers.",
    )
    fanout: int = Field(2, description="relay: generators the publisher sends an update to directly (k).", ge=1, le=64)
    relay_fanout: int = Field(
        1,
        description="relay: children per relaying generator. 1 = pipelined chains: each generator's uplink carries "
        "an update once, as in a ring broadcast; more = a shallower tree that shares each uplink among its children.",
        ge=1,
        le=64,
    )
    chunk_mb: float = Field(
        4.0, description="relay: bytes per checksummed chunk, in MiB (a relay forwards each as it arrives).", gt=0
    )
    stall_timeout_s: float = Field(
        5.0,
        description="relay: a parent that sends no chunk for this long is dropped and the generator re-attaches.",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    relay_host: Host = Field(
        "127.0.0.1",
        description="relay: address a generator's relay server binds, reachable by the other generators (any "
        "non-loopback one needs run.curve_keys_dir or run.insecure).",
    )
    host_id: str = Field(
        "",
        description="Generators with the same host_id share one received copy in shared memory (empty = this "
        "machine: its hostname and boot id).",
        max_length=200,
    )
    share_host_copy: bool = Field(
        True, description="One generator per host receives each update; the others on the host map its copy."
    )
    broadcast_host: Host = Field(
        "127.0.0.1",
        description="broadcast: address of the group's rendezvous, hosted by learner rank 0 (every generator "
        "connects there). The group is unauthenticated: a non-loopback address needs run.insecure.",
    )
    broadcast_port: int = Field(
        29517,
        description="broadcast: TCP port of the group's rendezvous (unset: run.port_base + 2, else 29517).",
        ge=1,
        le=65535,
    )
    broadcast_backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto",
        description="broadcast: nccl (CUDA: vLLM's StatelessProcessGroup + PyNcclCommunicator; never run on a GPU "
        "yet), gloo (CPU) or auto (nccl where CUDA is available, else gloo).",
    )
    broadcast_join_timeout_s: float = Field(
        120.0,
        description="broadcast: longest wait for a round's members to form its group (a new group forms when a "
        "generator joins, dies or misses a round).",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    broadcast_ready_timeout_s: float = Field(
        10.0,
        description="broadcast: longest wait, after a round is announced, for every generator to be ready to "
        "receive it at once; the late ones take the next round (they keep their weights meanwhile).",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    broadcast_timeout_s: float = Field(
        60.0,
        description="broadcast: longest wait for each collective of a round; a member that died or stalled fails "
        "the round on every member within this, and the next round forms a new group without it.",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
