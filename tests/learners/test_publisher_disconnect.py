"""How the publisher drops a stalled reader (common.connections.tcp_connection / disconnect_tcp): it shuts down the
connection a request came on, and never another one that reuses its descriptor number."""

from __future__ import annotations

import os
import socket

from common.connections import disconnect_tcp, tcp_connection


def connected_pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    return client, server


def test_the_connection_is_shut_down_and_its_peer_sees_the_end() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client, server = connected_pair(listener)
        with client, server:
            connection = tcp_connection(server.fileno())
            assert connection is not None and connection[1] == client.getsockname()
            assert disconnect_tcp(connection)
            client.settimeout(5)
            assert client.recv(1) == b""  # end of stream (or a reset, once the descriptor is closed)


def test_a_descriptor_reused_by_another_connection_is_left_alone() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        first_client, first_server = connected_pair(listener)
        connection = tcp_connection(first_server.fileno())
        assert connection is not None
        number = first_server.detach()  # the descriptor stays open, owned by this test
        first_client.close()
        second_client, second_server = connected_pair(listener)
        os.dup2(second_server.fileno(), number)  # the old number now names another connection, as after a reuse
        try:
            with second_client, second_server:
                assert not disconnect_tcp(connection)  # another peer address: not the connection we meant
                second_client.sendall(b"x")
                second_server.settimeout(5)
                assert second_server.recv(1) == b"x"  # untouched
        finally:
            os.close(number)
    assert tcp_connection(-1) is None and disconnect_tcp(None) is False
