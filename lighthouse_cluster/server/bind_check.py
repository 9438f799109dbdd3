"""Starting a gRPC server on a port, and why a TCP port cannot be bound (gRPC's own bind error
does not say)."""

from __future__ import annotations

import errno
import os
import socket

import grpc

from lighthouse_cluster.tls import ServerTLS


async def start_listening(server: grpc.aio.Server, host: str, port: int, tls: ServerTLS | None) -> str | None:
    """Bind ``server`` on ``host:port`` (with ``tls``) and start it: None once it listens, else
    the one-line reason it cannot (the server is stopped then)."""
    address = f"{host}:{port}"
    try:
        if tls is not None:
            server.add_secure_port(address, tls.credentials())
        else:
            server.add_insecure_port(address)
        await server.start()
    except Exception as e:  # noqa: BLE001 -- RuntimeError from gRPC's bind; anything else alike
        await server.stop(None)
        return f"cannot listen on {address}: {bind_error(host, port) or str(e) or type(e).__name__}"
    return None


def bind_error(host: str, port: int) -> str | None:
    """Why a TCP listener cannot bind ``host:port`` now (``"Address already in use"``,
    ``"Permission denied"``), or None when it can: gRPC's own bind error does not say."""
    bare = host.strip("[]")
    try:
        infos = socket.getaddrinfo(bare or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot resolve {host!r}: {e.strerror}"
    family, _, _, _, address = infos[0]
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and bare == "::":
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind(address)
    except OSError as e:
        return e.strerror or os.strerror(e.errno or errno.EIO)
    return None
