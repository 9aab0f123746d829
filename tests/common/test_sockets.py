"""Sockets: request/reply over loopback, rejection of bad input without going down, timeouts and reconnection,
loopback-only binding unless CurveZMQ keys or an explicit opt-out, CurveZMQ actually authenticating, the sender's
role (from its key with CURVE, declared without), and keys at rest (0600 secrets, refused when others may read)."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from common.keys import ROLES, load_secret, write_keys
from common.sockets import Client, PeerUnavailable, SecurityError, Server, SocketSecurity, is_loopback, split_address
from common.types import ErrorReply, Ok, VersionReport
from common.wire import decode, encode
from launch.testing import free_port


class EchoServer:
    """Replies Ok(learner_version=policy_version) to every VersionReport, in a thread; records each sender's role."""

    def __init__(self, security: SocketSecurity, host: str = "127.0.0.1") -> None:
        self.port = free_port()
        self.server = Server(host, self.port, security, name="echo")
        self.stop = threading.Event()
        self.roles: list[str] = []
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while not self.stop.is_set():
            request = self.server.poll(50)
            if request is not None:
                self.roles.append(request.role)
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


def test_curve_authenticates_clients_and_their_key_is_their_role(tmp_path: Path) -> None:
    write_keys(tmp_path / "keys")
    secure = SocketSecurity(curve_keys_dir=tmp_path / "keys")
    server = EchoServer(secure, host="0.0.0.0")
    try:
        for version, role in enumerate(ROLES):
            client = Client(f"127.0.0.1:{server.port}", secure, "good", role=role)
            reply = client.request(VersionReport(policy_version=version, step=version), timeout_s=5)[0]
            assert reply == Ok(learner_version=version)
            client.close()
        assert server.roles == list(ROLES)
        plain = Client(f"127.0.0.1:{server.port}", SocketSecurity(), "plain", role="learner")  # no keys: refused
        with pytest.raises(PeerUnavailable):
            plain.request(VersionReport(policy_version=4, step=4), timeout_s=0.5)
        forged = _raw_curve_dealer(tmp_path / "keys", "generator", server.port, claim="learner")
        forged.send_multipart([b"", b"\x00" * 8, *encode(VersionReport(policy_version=7, step=7))])
        assert forged.poll(5000)
        forged.close(linger=0)
        assert server.roles[-1] == "generator"  # the key decides; what the peer declares is ignored under CURVE
    finally:
        server.close()


def _raw_curve_dealer(keys: Path, role: str, port: int, claim: str) -> zmq.Socket:
    """A DEALER with `role`'s key that declares the role `claim` in its handshake, as a forger would."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.curve_publickey, sock.curve_secretkey = load_secret(keys, role)
    sock.curve_serverkey = load_secret(keys, "server")[0]
    sock.setsockopt(zmq.METADATA, f"X-Tandem-Role:{claim}".encode())
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def test_without_keys_the_role_is_declared_per_connection(echo: EchoServer) -> None:
    for role in ("learner", None):
        client = Client(f"127.0.0.1:{echo.port}", SocketSecurity(), "declared", role=role)
        assert client.request(VersionReport(policy_version=1, step=1), timeout_s=5)[0] == Ok(learner_version=1)
        client.close()
    assert echo.roles == ["learner", ""]
    with pytest.raises(ValueError, match="not one of"):
        Client(f"127.0.0.1:{echo.port}", SocketSecurity(), "bad", role="admin")


def test_clients_of_one_name_get_distinct_connections(echo: EchoServer) -> None:
    """Routing ids are ZeroMQ's, not the client's: a second client named like the first cannot take its replies."""
    seen = []
    original = echo.server.reply

    def record(request, message, payload=()):  # a thin spy on the replies
        seen.append(request.sender)
        original(request, message, payload)

    echo.server.reply = record
    first, second = (Client(f"127.0.0.1:{echo.port}", SocketSecurity(), "twin", role="learner") for _ in range(2))
    second.identity = first.identity  # the same name, as a hijacker would claim it
    for client in (first, second):
        assert client.request(VersionReport(policy_version=2, step=2), timeout_s=5)[0] == Ok(learner_version=2)
        client.close()
    names = {sender.split("@")[0] for sender in seen}
    assert len(names) == 1 and len(set(seen)) == 2, seen


def test_write_keys_makes_private_secrets_and_refuses_to_overwrite(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    written = write_keys(keys)
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert {path.name for path in written} == {f"{n}.key{s}" for n in ("server", *ROLES) for s in ("", "_secret")}
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) == (0o600 if path.name.endswith("_secret") else 0o644), path
    with pytest.raises(SecurityError, match="already holds keys"):
        write_keys(keys)


def test_a_secret_key_others_can_read_is_refused(tmp_path: Path) -> None:
    write_keys(tmp_path)
    secret = tmp_path / "learner.key_secret"
    os.chmod(secret, 0o644)
    with pytest.raises(SecurityError, match=f"chmod 600 {secret}"):
        load_secret(tmp_path, "learner")
    client = Client("127.0.0.1:1", SocketSecurity(curve_keys_dir=tmp_path), "exposed", role="learner")
    with pytest.raises(SecurityError, match="chmod 600"):
        client.request(VersionReport(policy_version=1, step=1), timeout_s=0.1)
    os.chmod(tmp_path / "server.key_secret", 0o640)
    with pytest.raises(SecurityError, match="chmod 600"):
        Server("127.0.0.1", free_port(), SocketSecurity(curve_keys_dir=tmp_path), name="exposed")


def test_a_public_key_others_can_write_is_refused(tmp_path: Path) -> None:
    write_keys(tmp_path)
    os.chmod(tmp_path / "learner.key", 0o666)
    with pytest.raises(SecurityError, match="chmod go-w"):
        Server("127.0.0.1", free_port(), SocketSecurity(curve_keys_dir=tmp_path), name="swappable")


def test_the_old_shared_client_key_layout_is_refused_naming_tandem_keys(tmp_path: Path) -> None:
    zmq.auth.create_certificates(str(tmp_path), "server")
    zmq.auth.create_certificates(str(tmp_path), "client")
    with pytest.raises(SecurityError, match=f"tandem keys {tmp_path}"):
        Server("127.0.0.1", free_port(), SocketSecurity(curve_keys_dir=tmp_path), name="old")
    with pytest.raises(SecurityError, match="tandem keys"):
        load_secret(tmp_path, "generator")
    with pytest.raises(SecurityError, match="needs a role"):
        Client("127.0.0.1:1", SocketSecurity(curve_keys_dir=tmp_path), "role-less")


def test_addresses() -> None:
    assert split_address("127.0.0.1:5555") == ("127.0.0.1", 5555)
    assert split_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="host:port"):
        split_address("localhost")
    assert is_loopback("localhost") and is_loopback("127.0.0.2") and not is_loopback("10.0.0.1")
