"""Prometheus metrics endpoint."""

from __future__ import annotations

import prometheus_client


def start_metrics_server(port: int) -> int | None:
    """Serve /metrics on `port` (0: a free port). Returns the bound port, or None when disabled (-1)."""
    if port < 0:
        return None
    server, _thread = prometheus_client.start_http_server(port, addr="127.0.0.1")
    return server.server_port
