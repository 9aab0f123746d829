"""ZeroMQ sockets every role uses: a request/reply `Server` (ROUTER) and a reconnecting `Client` (DEALER).

    server = Server(host, port, security, name="buffer")
    while running:
        request = server.poll(timeout_ms=100)        # None on timeout; bad messages are counted, never raised
        if request is not None:
            server.reply(request, Ok(learner_version=3))   # now, or later (a deferred reply is allowed)

    client = Client("127.0.0.1:5555", security, identity="generator-0", role="generator")
    reply, payload = client.request(LeaseRequest(...), timeout_s=5)   # raises PeerUnavailable on timeout

Frames on the wire: DEALER sends [b"", request_id (8 bytes), *message frames]; the ROUTER prepends the routing id
that ZeroMQ gave the connection (the client sets none, so no peer can take over another's replies by naming
itself like it). Replies echo the request id, so a late reply to an abandoned request is recognised and dropped.

Roles: every `Request` carries the sender's role (one of `common.keys.ROLES`, or "" for none), fixed for the life
of its connection. With CurveZMQ keys (`run.curve_keys_dir`, made by `tandem keys DIR`) the role is the one whose
key the client connected with: a ZAP handler maps each public key to its role, which arrives as the message's
User-Id and cannot be forged. Without keys (loopback only) the client declares its role in the connection's
handshake metadata (X-Tandem-Role): loopback without keys trusts every local process to say who it is.

Security: binding a non-loopback address requires CurveZMQ keys or an explicit `insecure` opt-out, which logs a
warning. Every socket has a maximum message size (ZMQ_MAXMSGSIZE per frame, and the total checked by
`common.wire.decode`).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from common.config import is_loopback
from common.keys import ROLES, SecurityError, load_public, load_secret, role_public_keys
from common.serving import PROCESS_ENDING, RateLimitedLog, fault_kind
from common.types import ErrorReply
from common.wire import WireError, decode, encode

log = logging.getLogger("tandem.sockets")


class PeerUnavailable(ConnectionError):
    """The peer did not answer in time (dead, restarting, or overloaded). The caller decides how to back off."""


__all__ = ["ROLES", "Client", "PeerUnavailable", "Request", "SecurityError", "Server", "SocketSecurity"]
_ROLE_PROPERTY = "X-Tandem-Role"  # the role a client declares in its handshake (used without CURVE only)
_NAME_PROPERTY = "X-Tandem-Name"  # the client's name, for logs (never trusted)


@dataclass(frozen=True)
class SocketSecurity:
    """What every socket needs to know about security and limits (built from `RunConfig`)."""

    curve_keys_dir: Path | None = None
    insecure: bool = False
    max_message_bytes: int = 1 << 30

    @classmethod
    def from_run(cls, run: Any) -> SocketSecurity:
        return cls(run.curve_keys_dir, run.insecure, int(run.max_message_mb * (1 << 20)))


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address '{address}' must look like host:port")
    return host.strip("[]"), int(port)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now. Whoever binds it a moment later may find it taken by another
    process in between (then the bind fails with "address in use"): a race to live with, not to hide."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class _RoleKeys:
    """The ZAP credentials provider and User-Id map: a client may connect iff its public key is a role's key."""

    def __init__(self) -> None:
        self.roles: dict[bytes, str] = {}  # z85 public key -> role

    def callback(self, domain: str, z85_key: bytes) -> bool:
        return z85_key in self.roles


def _start_authenticator(ctx: zmq.Context) -> _RoleKeys:
    """One ZAP handler per context (ZeroMQ allows one); its User-Id for a client is the role of the client's key."""
    from zmq.auth.thread import ThreadAuthenticator
    from zmq.utils import z85

    keys = _RoleKeys()

    class RoleAuthenticator(ThreadAuthenticator):
        def curve_user_id(self, client_public_key: bytes) -> str:
            return keys.roles.get(z85.encode(client_public_key), "")

    auth = RoleAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=keys)
    _authenticators[id(ctx)] = (auth, keys)
    return keys


_authenticators: dict[int, tuple[Any, _RoleKeys]] = {}


def release_context() -> None:
    """Close every socket of this process's ZeroMQ context (`zmq.Context.instance()`, which every `Server` and
    `Client` uses) and return only when ZeroMQ has let go of every message. Call it once, when the process is done
    with its sockets: `tandem ROLE` does, after the role's `run` returns or raises.

    Why: messages go out zero-copy, so a frame points into a numpy buffer (a weights bucket, a batch) until ZeroMQ's
    I/O thread has written it. A process that exits with such a reply in flight frees the buffer under that thread,
    and libzmq aborts ("Bad address (src/tcp.cpp:227)") or the process segfaults: seen as a learner that exited
    -6/-11 after its last step while a generator was still fetching the final weights. Terminating the context drops
    what is pending (linger 0) and waits for the I/O threads. A later `Server` or `Client` gets a fresh context.
    """
    PROCESS_ENDING.set()  # serving threads whose sockets close now end quietly (common.serving)
    context = zmq.Context.instance()
    authenticator = _authenticators.pop(id(context), None)
    if authenticator is not None:
        authenticator[0].stop()
    context.destroy(linger=0)


def _configure_server_security(ctx: zmq.Context, sock: zmq.Socket, host: str, security: SocketSecurity) -> None:
    if security.curve_keys_dir is not None:
        public, secret = load_secret(security.curve_keys_dir, "server")
        roles = role_public_keys(security.curve_keys_dir)
        keys = _authenticators[id(ctx)][1] if id(ctx) in _authenticators else _start_authenticator(ctx)
        clash = {key: role for key, role in roles.items() if keys.roles.get(key, role) != role}
        if clash:
            raise SecurityError(
                f"{security.curve_keys_dir}: a key of role {next(iter(clash.values()))!r} is another role's key in "
                "a keys dir this process already serves: give every role its own key (tandem keys DIR)"
            )
        keys.roles.update(roles)  # servers of one process share the handler: it admits the keys of each dir
        sock.curve_publickey, sock.curve_secretkey, sock.curve_server = public, secret, True
    elif not is_loopback(host):
        if not security.insecure:
            raise SecurityError(
                f"binding {host} exposes the socket beyond this machine: set run.curve_keys_dir "
                "(CurveZMQ keys) or run.insecure = true on a trusted network"
            )
        log.warning("binding %s WITHOUT encryption or authentication (run.insecure = true)", host)


class Server:
    """A ROUTER socket that receives validated requests and sends replies (possibly deferred).

    Malformed, oversized or wrong-version messages never raise out of `poll`, nor does any other exception raised
    while one is decoded (counted as `internal_<ExceptionName>`): the sender gets an `ErrorReply`, the rejection is
    counted in `rejected` under its kind and logged once per kind per `common.serving.LOG_EVERY_S`. Each `Request` says the
    sender's role (see the module docstring): the User-Id with CURVE, the declared role without.
    """

    def __init__(
        self, host: str, port: int, security: SocketSecurity, name: str, roles: Sequence[str] | None = None
    ) -> None:
        """`roles`: when given, a message from a peer of another role (or of none) is refused before its body is
        decoded (`forbidden_role`): a service that answers only some roles spends nothing on the others."""
        self.name = name
        self.security = security
        self.roles = None if roles is None else frozenset(roles)
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, security.max_message_bytes)
        self.socket.setsockopt(zmq.RCVHWM, 10_000)
        _configure_server_security(self.context, self.socket, host, security)
        try:
            self.socket.bind(_tcp(host, port))
        except zmq.ZMQError as error:
            self.socket.close()
            raise OSError(f"{name}: cannot bind {host}:{port}: {error} (is another run using this port?)") from None
        self.rejected: Counter[str] = Counter()
        self._rejections = RateLimitedLog(log)  # one line per kind per LOG_EVERY_S: a flood cannot fill the disk
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)

    def poll(self, timeout_ms: int) -> Request | None:
        """The next valid request, or None when nothing valid arrived within the timeout."""
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            remaining = max(0, int((deadline - time.monotonic()) * 1000))
            if not self.poller.poll(remaining):
                return None
            frames = self.socket.recv_multipart(copy=False)
            try:
                request = self._parse(frames)
            except Exception as error:  # noqa: BLE001 - a decoder bug is one rejected message, not a dead service
                request = None
                self._reject_fault(frames, error)
            if request is not None:
                return request
            if time.monotonic() >= deadline:
                return None

    def _parse(self, frames: list[zmq.Frame]) -> Request | None:
        identity = frames[0].bytes
        if len(frames) < 4 or frames[1].bytes != b"" or len(frames[2].bytes) != 8:
            self._reject(identity, None, "bad envelope: expected [identity, '', request id, frames...]", "bad_envelope")
            return None
        request_id = frames[2].bytes
        role = _property(frames[3], "User-Id" if self.security.curve_keys_dir is not None else _ROLE_PROPERTY)
        role = role if role in ROLES else ""
        if self.roles is not None and role not in self.roles:
            reason = f"role {role or 'none'!r} may not ask {self.name} (only {', '.join(sorted(self.roles))})"
            self._reject(identity, request_id, reason, "forbidden_role")
            return None
        try:
            message, payload = decode(frames[3:], self.security.max_message_bytes)
        except WireError as error:
            self._reject(identity, request_id, error.reason, error.kind)
            return None
        return Request(identity, request_id, message, payload, role, _name(frames[3]), _source_fd(frames[0]))

    def _reject_fault(self, frames: list[zmq.Frame], error: Exception) -> None:
        """Reject a message whose parsing raised something else than WireError (`common.serving`)."""
        kind = fault_kind(error)
        self._rejections.log(
            logging.ERROR, f"trace:{kind}", "%s: decoding a message raised %r", self.name, error, exc_info=error
        )
        identity = frames[0].bytes
        request_id = frames[2].bytes if len(frames) > 2 and len(frames[2].bytes) == 8 else None
        self._reject(identity, request_id, f"internal error while decoding: {type(error).__name__}", kind)

    def _reject(self, identity: bytes, request_id: bytes | None, reason: str, kind: str) -> None:
        self.rejected[kind] += 1
        self._rejections.log(
            logging.WARNING, kind, "%s: rejected a message from %r (%s): %s", self.name, identity, kind, reason
        )
        if request_id is not None:
            self._send(identity, request_id, encode(ErrorReply(reason=reason, kind=kind)))

    def reject(self, request: Request, reason: str, kind: str = "refused") -> None:
        """Refuse a well-formed message whose content is not acceptable (counted like malformed input)."""
        self._reject(request.identity, request.request_id, reason, kind)

    def reply(self, request: Request, message: Any, payload: Sequence[Any] = ()) -> None:
        self._send(request.identity, request.request_id, encode(message, payload))

    def _send(self, identity: bytes, request_id: bytes, frames: list[Any]) -> None:
        try:
            self.socket.send_multipart([identity, b"", request_id, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError as error:  # the peer is gone or its queue is full: it will retry its request
            log.warning("%s: reply to %r dropped: %s", self.name, identity, error)

    def close(self) -> None:
        self.socket.close(linger=0)


def _property(frame: zmq.Frame, name: str) -> str:
    """A connection property of a received frame ("" when the connection has none of that name)."""
    try:
        return frame.get(name)
    except zmq.ZMQError:
        return ""


def _source_fd(frame: zmq.Frame) -> int:
    """The descriptor of the TCP connection a received frame came on (ZMQ_SRCFD), -1 when unknown."""
    try:
        return int(frame.get(zmq.SRCFD))
    except zmq.ZMQError:
        return -1


def _name(frame: zmq.Frame) -> str:
    name = _property(frame, _NAME_PROPERTY)
    return "".join(c if c.isprintable() else "?" for c in name[:64]) or "?"


@dataclass
class Request:
    identity: bytes  # the connection's ZeroMQ routing id (ZeroMQ chose it: unique per connection, unforgeable)
    request_id: bytes
    message: Any
    payload: list[memoryview]
    role: str = ""  # one of common.keys.ROLES, or "" (none declared / key of no role)
    name: str = "?"  # what the client calls itself (for logs only: any peer may claim any name)
    peer_fd: int = -1  # its TCP connection's descriptor (ZMQ_SRCFD; -1 unknown): how a server drops a stalled peer

    @property
    def sender(self) -> str:
        """'name@routing-id': who it claims to be, and which connection it is (unique while connected)."""
        return f"{self.name}@{self.identity.hex()}"


class Client:
    """A DEALER socket with request/reply semantics, timeouts and reconnection (the Lazy Pirate pattern).

    After a timeout the socket is closed and reopened, so no stale request is delivered later and no stale
    reply is mistaken for a new one. Safe to use from one thread at a time.

    `role` (one of `common.keys.ROLES`) is what the server lets this client do: with CURVE it picks the key
    (`ROLE.key_secret`), without CURVE it is declared at connect. None: no role (loopback only; a server then
    answers only what anyone may ask, e.g. the buffer's stats).
    """

    _ids = itertools.count()
    HEARTBEAT_MS = 1000  # immediate clients: ZMTP heartbeats, so that a connection to a dead host is dropped ...
    HEARTBEAT_TIMEOUT_MS = 5000  # ... this long after the peer stopped answering them

    def __init__(
        self, address: str, security: SocketSecurity, identity: str, role: str | None = None, immediate: bool = False
    ) -> None:
        """`immediate`: queue a message only on a live connection (ZMQ_IMMEDIATE, with heartbeats): while the
        peer is away `send` raises zmq.Again instead of queueing requests that a restarted peer would answer
        long after the caller gave up on them."""
        if role is not None and role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
        if role is None and security.curve_keys_dir is not None:
            raise SecurityError(f"client '{identity}': with run.curve_keys_dir set, a client needs a role (its key)")
        self.host, self.port = split_address(address)
        self.security = security
        self.role = role
        self.identity = f"{identity}-{os.getpid()}-{next(self._ids)}"
        self.context = zmq.Context.instance()
        self._sequence = itertools.count(1)
        self.socket: zmq.Socket | None = None
        self.immediate = immediate

    def _open(self) -> zmq.Socket:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.immediate:
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.HEARTBEAT_IVL, self.HEARTBEAT_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.METADATA, f"{_NAME_PROPERTY}:{self.identity}".encode())
        if self.role is not None:
            sock.setsockopt(zmq.METADATA, f"{_ROLE_PROPERTY}:{self.role}".encode())
        sock.setsockopt(zmq.MAXMSGSIZE, self.security.max_message_bytes)
        if self.security.curve_keys_dir is not None:
            public, secret = load_secret(self.security.curve_keys_dir, self.role)
            server_public = load_public(self.security.curve_keys_dir, "server")
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_public
        sock.connect(_tcp(self.host, self.port))
        return sock

    def request(self, message: Any, timeout_s: float, payload: Sequence[Any] = ()) -> tuple[Any, list[memoryview]]:
        """Send and wait for the matching reply. Raises `PeerUnavailable` on timeout, `WireError` on a bad reply."""
        if self.socket is None:
            self.socket = self._open()
        request_id = struct.pack("<Q", next(self._sequence))
        deadline = time.monotonic() + timeout_s
        # The send waits at most timeout_s too: a DEALER with no pipe to queue on (a handshake the server refused,
        # e.g. a client without the CURVE keys, drops it until the reconnect) blocks in send, and once hung a
        # test's whole run with it.
        self.socket.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        try:
            self.socket.send_multipart([b"", request_id, *encode(message, payload)], copy=False)
        except zmq.Again:
            self.reset()
            raise PeerUnavailable(f"could not send to {self.host}:{self.port} within {timeout_s:.1f}s") from None
        while (remaining := deadline - time.monotonic()) > 0:
            if not self.socket.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                continue
            frames = self.socket.recv_multipart(copy=False)
            if len(frames) < 3 or frames[1].bytes != request_id:
                continue  # a late reply to an abandoned request
            return decode(frames[2:], self.security.max_message_bytes)
        self.reset()
        raise PeerUnavailable(f"no reply from {self.host}:{self.port} within {timeout_s:.1f}s")

    def send(self, message: Any) -> bytes:
        """Send without waiting for the reply (several requests may be in flight; the caller matches the replies
        that `receive` returns). Returns the envelope's request id. Raises zmq.Again when ZeroMQ cannot queue it
        now (an `immediate` client without a live connection, or a full queue)."""
        if self.socket is None:
            self.socket = self._open()
        request_id = struct.pack("<Q", next(self._sequence))
        self.socket.send_multipart([b"", request_id, *encode(message)], copy=False, flags=zmq.NOBLOCK)
        return request_id

    def receive(self, timeout_s: float) -> tuple[bytes, Any] | None:
        """The next reply to any request sent (its envelope's request id, the decoded message) within `timeout_s`,
        else None. Raises `WireError` for a malformed reply."""
        if self.socket is None:
            self.socket = self._open()
        if not self.socket.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
            return None
        frames = self.socket.recv_multipart(copy=False)
        if len(frames) < 3 or len(frames[1].bytes) != 8:
            raise WireError("reply without the envelope [b'', request id, frames...]", "bad_envelope")
        message, _ = decode(frames[2:], self.security.max_message_bytes)
        return frames[1].bytes, message

    def reset(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None

    def close(self) -> None:
        self.reset()


def backoff_delays(max_s: float, base_s: float = 0.1) -> itertools.chain:
    """0.1, 0.2, 0.4, ... capped at `max_s`, forever: the waits between reconnect attempts."""
    return itertools.chain((min(max_s, base_s * 2**i) for i in range(32)), itertools.repeat(max_s))
