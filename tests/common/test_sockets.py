"""Sockets: request/reply over loopback, rejection of bad input without going down, timeouts and reconnection,
loopback-only binding unless CurveZMQ keys or an explicit opt-out, and CurveZMQ actually authenticating."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from common.sockets import Client, PeerUnavailable, SecurityError, Server, SocketSecurity, is_loopback, split_address
from common.types import ErrorReply, Ok, VersionReport
from common.wire import decode
from launch.testing import free_port


class EchoServer:
    """Replies Ok(learner_version=policy_version) to every VersionReport, in a thread."""

    def __init__(self, security: SocketSecurity, host: str = "127.0.0.1") -> None:
        self.port = free_port()
        self.server = Server(host, self.port, security, name="echo")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while not self.stop.is_set():
            request = self.server.poll(50)
            if request is not None:
                self.server.reply(request, Ok(learner_version=request.message.policy_version))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.server.close()


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer(SocketSecurity())
    yield server
    server.close()


def test_request_reply(echo: EchoServer) -> None:
    client = Client(f"127.0.0.1:{echo.port}", SocketSecurity(), "test")
    for version in range(5):
        reply, payload = client.request(VersionReport(policy_version=version, step=version), timeout_s=5)
        assert reply == Ok(learner_version=version) and payload == []
    client.close()


def test_garbage_is_answered_counted_and_survived(echo: EchoServer) -> None:
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(f"tcp://127.0.0.1:{echo.port}")
    raw.send_multipart([b"", b"\x00" * 8, b"\xc1garbage"])
    assert raw.poll(5000)
    reply, _ = decode(raw.recv_multipart()[2:])
    assert isinstance(reply, ErrorReply) and "msgpack" in reply.reason
    raw.send_multipart([b"no-envelope"])  # no reply possible, but counted
    raw.close(linger=0)
    client = Client(f"127.0.0.1:{echo.port}", SocketSecurity(), "test")
    assert client.request(VersionReport(policy_version=1, step=1), timeout_s=5)[0] == Ok(learner_version=1)
    assert echo.server.rejected["garbage"] == 1 and echo.server.rejected["bad_envelope"] == 1


def test_timeout_then_reconnect_to_a_restarted_server() -> None:
    port = free_port()
    client = Client(f"127.0.0.1:{port}", SocketSecurity(), "test")
    with pytest.raises(PeerUnavailable):
        client.request(VersionReport(policy_version=1, step=1), timeout_s=0.2)
    server = Server("127.0.0.1", port, SocketSecurity(), name="late")
    try:
        thread = threading.Thread(
            target=lambda: server.reply(r, Ok(learner_version=9)) if (r := server.poll(5000)) else None
        )
        thread.start()
        assert client.request(VersionReport(policy_version=9, step=9), timeout_s=5)[0] == Ok(learner_version=9)
        thread.join()
    finally:
        server.close()


def test_non_loopback_bind_needs_keys_or_opt_out() -> None:
    with pytest.raises(SecurityError, match="curve_keys_dir"):
        Server("0.0.0.0", free_port(), SocketSecurity(), name="exposed")
    server = Server("0.0.0.0", free_port(), SocketSecurity(insecure=True), name="opted-out")
    server.close()


def test_curve_authenticates_clients(tmp_path: Path) -> None:
    zmq.auth.create_certificates(str(tmp_path), "server")
    zmq.auth.create_certificates(str(tmp_path), "client")
    secure = SocketSecurity(curve_keys_dir=tmp_path)
    server = EchoServer(secure, host="0.0.0.0")
    try:
        good = Client(f"127.0.0.1:{server.port}", secure, "good")
        assert good.request(VersionReport(policy_version=3, step=3), timeout_s=5)[0] == Ok(learner_version=3)
        plain = Client(f"127.0.0.1:{server.port}", SocketSecurity(), "plain")  # no keys: never gets through
        with pytest.raises(PeerUnavailable):
            plain.request(VersionReport(policy_version=4, step=4), timeout_s=0.5)
    finally:
        server.close()


def test_addresses() -> None:
    assert split_address("127.0.0.1:5555") == ("127.0.0.1", 5555)
    assert split_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="host:port"):
        split_address("localhost")
    assert is_loopback("localhost") and is_loopback("127.0.0.2") and not is_loopback("10.0.0.1")
