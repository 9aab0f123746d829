"""The TCP connection a ZeroMQ request came on, and how a server drops it (a peer that stopped reading its replies).

    connection = tcp_connection(request.peer_fd)     # when the reply goes out
    ...
    disconnect_tcp(connection)                       # later, if the reply is still unsent: ZeroMQ frees it

Used by the weights publisher (learners/publisher.py) and a generator's relay server (actors/weights/relay.py): both send
large replies zero-copy, and a reader that never reads would otherwise pin them for as long as it stays connected.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

TcpConnection = tuple[int, Any]  # (descriptor, peer address when the request came)


def tcp_connection(fd: int) -> TcpConnection | None:
    """The descriptor and peer address of a request's TCP connection; None when unknown or already closed."""
    if fd < 0:
        return None
    try:
        with _socket_of(fd) as sock:
            return fd, sock.getpeername()
    except OSError:
        return None


def disconnect_tcp(connection: TcpConnection | None) -> bool:
    """Shut down the TCP connection (its peer must reconnect), if the descriptor is still the same connection;
    returns whether it did. Unsent bytes are discarded (SO_LINGER 0: a reset once ZeroMQ closes it)."""
    if connection is None:
        return False
    fd, peer = connection
    try:
        with _socket_of(fd) as sock:
            if sock.getpeername() != peer:
                return False  # the descriptor was closed and reused by another connection
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        return False  # already closed
    return True


def _socket_of(fd: int) -> socket.socket:
    """A socket object on a duplicate of `fd` (closing it leaves `fd` open); OSError if `fd` is no socket."""
    duplicate = os.dup(fd)
    try:
        return socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)
        raise
