"""Issue 37, item 6 (reward service): no one request holds the service. Before the fix a peer with no role sent a
400 MB message that the service decoded before refusing it (RSS 517 -> 1,298 MB). Played here against the real
socket (`open_reward_server`) with a fake scorer. (The fairness half, a small request not starved behind a huge
batch, is tests/actors/test_reward_service.py::test_a_small_request_is_not_starved_behind_a_huge_batch.)
"""

from __future__ import annotations

import struct

import zmq

from actors.rewards.service import MAX_REQUEST_MB, RewardService, open_reward_server
from common import sockets
from common.sockets import SocketSecurity, free_port
from common.types import RewardRequest
from common.wire import encode
from launch.testing import wait_until

PROMPT = [{"role": "user", "content": "What is 2 + 5?"}]


class CountingScorer:
    batch_size = 8

    def __init__(self) -> None:
        self.scored = 0

    def score_chats(self, chats: list) -> list[float]:
        self.scored += len(chats)
        return [float(len(chat[-1]["content"])) for chat in chats]


def raw_peer(port: int, role: bytes | None) -> zmq.Socket:
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    if role is not None:
        peer.setsockopt(zmq.METADATA, b"X-Tandem-Role:" + role)
    peer.connect(f"tcp://127.0.0.1:{port}")
    return peer


def test_a_roleless_or_oversized_request_is_refused_before_its_body_is_decoded(monkeypatch) -> None:
    decoded: list[int] = []
    decode = sockets.decode
    monkeypatch.setattr(sockets, "decode", lambda frames, limit: decoded.append(1) or decode(frames, limit))
    port = free_port()
    server = open_reward_server("127.0.0.1", port, SocketSecurity())
    service = RewardService(CountingScorer(), server)
    big = ["x" * (1 << 20)] * 20  # 20 MB of completions
    roleless, oversized = raw_peer(port, None), raw_peer(port, b"generator")
    try:
        roleless.send_multipart([b"", struct.pack("<Q", 1), *encode(RewardRequest(1, PROMPT, big))])
        huge = ["x" * (1 << 20)] * (MAX_REQUEST_MB + 8)  # over the service's limit: ZeroMQ drops it unread
        oversized.send_multipart([b"", struct.pack("<Q", 2), *encode(RewardRequest(2, PROMPT, huge))])
        wait_until(lambda: service.serve_batch(0.05) >= 0 and server.rejected["forbidden_role"] == 1, 20, "refusal")
        for _ in range(10):
            service.serve_batch(0.05)
        assert decoded == [] and service.counters.groups == 0  # neither body was decoded
        assert roleless.poll(5000) and b"forbidden_role" in b"".join(roleless.recv_multipart()[2:])
        honest = raw_peer(port, b"generator")  # the service still answers a generator
        honest.send_multipart([b"", struct.pack("<Q", 3), *encode(RewardRequest(3, PROMPT, ["7"]))])
        wait_until(lambda: service.serve_batch(0.05) == 1, 20, "the honest request answered")
        honest.close()
    finally:
        roleless.close()
        oversized.close()
        server.close()
