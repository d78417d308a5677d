"""Prometheus metrics endpoint."""

from __future__ import annotations

import ipaddress

import prometheus_client

from services.common.errors import FieldError


def start_metrics_server(port: int, address: str = "127.0.0.1") -> int | None:
    """Serve /metrics on `address`:`port` (0: a free port). Returns the bound port, or None when disabled (-1).

    Loopback by default (a local run's metrics are for its own host); the deployments set 0.0.0.0 so Prometheus
    can reach it, and their network policies say from where."""
    try:
        ipaddress.ip_address(address)
    except ValueError:
        raise FieldError("metrics_address", f"{address!r} is not an IP address (e.g. 127.0.0.1 or 0.0.0.0)") from None
    if port < 0:
        return None
    server, _thread = prometheus_client.start_http_server(port, addr=address)
    return server.server_port
