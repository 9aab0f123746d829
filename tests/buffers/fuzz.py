"""Fuzzing the buffer's socket: random bytes, mutated valid messages, wrong versions and types, broken frames,
oversized messages, broken envelopes and well-formed but unacceptable requests, from three raw DEALER sockets:
one declares the generator role, one the learner role and one none (each message goes out on a random one), so
that requests both reach the checks of their content and meet the role checks.

Every message carries a unique request id, so each reply is matched to its message. Messages are sent in
windows (so the buffer's send queue never overflows) and every window's replies are awaited.
"""

from __future__ import annotations

import random
import struct
import time
from dataclasses import dataclass

import msgpack
import zmq

from common.sockets import split_address
from common.types import (
    BatchRequest,
    ErrorReply,
    GroupAck,
    Heartbeat,
    LeaseRequest,
    LeaseReturn,
    StatsRequest,
    VersionReport,
)
from common.weight_messages import WeightsRequest
from common.wire import decode, encode
from tests.buffers.fakes import make_group

WINDOW = 200
ROLES = ("generator", "learner", None)


@dataclass
class FuzzOutcome:
    sent: int = 0
    unanswered: int = 0
    error_replies: int = 0
    rejected_acks: int = 0
    other_replies: int = 0
    bad_envelopes: int = 0  # sent without a proper envelope: counted by the buffer, never answered


def _valid_messages() -> list[list[bytes]]:
    """Well-formed messages to mutate (no BatchRequest: a mutated timeout could hold it for minutes)."""
    group = make_group(lease_id=3, prompt=(1, 0), size=4)
    messages = [
        group,
        LeaseRequest(1000, 2, 0),
        Heartbeat(1000, 0, [1, 2]),
        StatsRequest(),
        VersionReport(0, 0),
        LeaseReturn(1000, 5, [1]),
    ]
    return [[bytes(frame) for frame in encode(m)] for m in messages]


def _header(kind: str, fields: dict, protocol: int = 1, arrays: int = 0) -> bytes:
    return msgpack.packb({"p": protocol, "t": kind, "a": arrays, "f": fields})


def _message(rng: random.Random, valid: list[list[bytes]]) -> tuple[list[bytes], bool]:
    """(frames, proper envelope?) of one fuzzed message."""
    choice = rng.randrange(12)
    if choice == 0:  # random bytes
        return [rng.randbytes(rng.randrange(1, 200)) for _ in range(rng.randrange(1, 4))], True
    if choice in (1, 2, 3):  # a valid message with a few bytes of its header flipped
        frames = [bytearray(f) for f in rng.choice(valid)]
        for _ in range(rng.randrange(1, 4)):
            frames[0][rng.randrange(len(frames[0]))] = rng.randrange(256)
        return [bytes(f) for f in frames], True
    if choice == 4:  # wrong protocol version
        return [_header("stats_request", {}, protocol=rng.choice([0, 2, 99]))], True
    if choice == 5:  # unknown type
        return [_header(rng.choice(["nope", "lease", "weights"]), {})], True
    if choice == 6:  # an array frame truncated or missing
        frames = list(rng.choice(valid[:1]))
        if rng.random() < 0.5:
            frames[1] = frames[1][: len(frames[1]) // 2]
        else:
            frames = frames[:-1]
        return frames, True
    if choice == 7:  # fields of the wrong type
        return [_header("lease_request", {"generator_id": "x", "max_prompts": 2, "policy_version": 0})], True
    if choice == 8:  # oversized: every frame fits the socket's limit, their total does not
        return [_header("stats_request", {}), b"\0" * 600_000, b"\0" * 600_000], True
    if choice == 9:  # a broken envelope (no empty delimiter frame)
        return [rng.randbytes(8)], False
    if choice == 10:  # well-formed, unacceptable requests
        bad = rng.choice(
            [BatchRequest(0, 3, 2, 4, 0.0), WeightsRequest(0, -1), LeaseReturn(0, 4242, [1]), LeaseRequest(0, -1, 0)]
        )
        return [bytes(f) for f in encode(bad)], True
    group = make_group(lease_id=rng.randrange(10_000, 20_000), prompt=(rng.randrange(24), 0), size=4)
    return [bytes(f) for f in encode(group)], True  # a group for a lease nobody issued


def fuzz_buffer(address: str, count: int, seed: int, reply_timeout_s: float = 20.0) -> FuzzOutcome:
    """Send `count` fuzzed messages and classify the replies."""
    rng = random.Random(seed)
    valid = _valid_messages()
    host, port = split_address(address)
    sockets = [_dealer(host, port, role) for role in ROLES]
    outcome = FuzzOutcome()
    try:
        next_id = 1
        while outcome.sent < count:
            waiting = set()
            for _ in range(min(WINDOW, count - outcome.sent)):
                frames, envelope = _message(rng, valid)
                socket = rng.choice(sockets)
                request_id = struct.pack("<Q", next_id)
                next_id += 1
                if envelope:
                    socket.send_multipart([b"", request_id, *frames])
                    waiting.add(request_id)
                else:
                    socket.send_multipart([b"x" + request_id, *frames])
                    outcome.bad_envelopes += 1
                outcome.sent += 1
            _collect(sockets, waiting, outcome, reply_timeout_s)
            outcome.unanswered += len(waiting)
    finally:
        for socket in sockets:
            socket.close()
    return outcome


def _dealer(host: str, port: int, role: str | None) -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if role is not None:
        socket.setsockopt(zmq.METADATA, f"X-Tandem-Role:{role}".encode())  # as common.sockets.Client declares it
    socket.connect(f"tcp://{host}:{port}")
    return socket


def _collect(sockets: list[zmq.Socket], waiting: set[bytes], outcome: FuzzOutcome, timeout_s: float) -> None:
    poller = zmq.Poller()
    for socket in sockets:
        poller.register(socket, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:
        for socket, _ in poller.poll(100):
            frames = socket.recv_multipart()
            if len(frames) >= 3 and frames[1] in waiting:
                waiting.discard(frames[1])
                _classify(frames, outcome)


def _classify(frames: list[bytes], outcome: FuzzOutcome) -> None:
    reply, _ = decode(frames[2:])
    if isinstance(reply, ErrorReply):
        outcome.error_replies += 1
    elif isinstance(reply, GroupAck) and reply.status == "rejected":
        outcome.rejected_acks += 1
    else:
        outcome.other_replies += 1
