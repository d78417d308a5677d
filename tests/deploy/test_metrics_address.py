"""The metrics endpoint's address (services.common.metrics, ServiceConfig.metrics_address): loopback by default,
reachable from other hosts when the deployments ask for 0.0.0.0, and a bad address refused naming the field."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest

from services.common.config import ServiceConfig, load_config
from services.common.metrics import start_metrics_server


def outward_ip() -> str:
    """This host's address on its default route (no packet is sent: a UDP connect only picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))     # TEST-NET-1: never routed anywhere
        except OSError:
            pytest.skip("no non-loopback route on this host")
        ip = s.getsockname()[0]
    if ip.startswith("127.") or ip == "0.0.0.0":
        pytest.skip("no non-loopback address on this host")
    return ip


def scrape(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=3) as reply:
            return reply.status == 200 and b"python_info" in reply.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def test_the_default_is_loopback_only():
    assert ServiceConfig().metrics_address == "127.0.0.1"
    ip = outward_ip()
    port = start_metrics_server(0)
    assert scrape("127.0.0.1", port) and not scrape(ip, port)


def test_metrics_address_all_interfaces_is_reachable_off_loopback():
    ip = outward_ip()
    config = load_config(ServiceConfig, "builder", env={"MESHRL_BUILDER__METRICS_ADDRESS": "0.0.0.0"})
    port = start_metrics_server(0, config.metrics_address)
    assert scrape(ip, port)


def test_a_bad_metrics_address_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="metrics_address: 'prometheus.local' is not an IP address"):
        start_metrics_server(0, "prometheus.local")
    assert start_metrics_server(-1, "0.0.0.0") is None
