"""Small network helpers every service and the launcher share."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (another process may take it before the caller binds it)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct TCP ports free on `host` now. Distinct because every socket stays bound until all are picked:
    separate `free_port()` calls may return the same port twice, and gRPC servers bind with SO_REUSEPORT, so two
    services then share one port without an error and each gets half of the other's calls ("Method not found")."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
