"""Listening sockets for our HTTP servers (worker, gateway, test servers), and how a node hands
its worker the secret that guards the worker's port."""

from __future__ import annotations

import socket

# The environment variable that carries a node-started worker's secret (see worker/app.py).
SECRET_ENV = "MLX_MESH_WORKER_SECRET"


def bind_socket(host: str, port: int, backlog: int = 512) -> socket.socket:
    """A listening socket (port 0 picks a free one) so the URL is known before serving.

    proto must say TCP: asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP,
    and without it every stream's first frame waits ~40 ms for the client's delayed ACK.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock
