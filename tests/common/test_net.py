"""Free ports: the launcher's random ports are distinct (two services on one port would share it silently, since
gRPC binds with SO_REUSEPORT)."""

from __future__ import annotations

from launcher.stack import random_ports
from services.common.net import free_port, free_ports


def test_free_ports_are_distinct_and_bindable():
    import socket

    ports = free_ports(64)
    assert len(set(ports)) == 64
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))


def test_the_stacks_random_ports_never_repeat():
    for _ in range(50):
        ports = list(random_ports().values())
        assert len(set(ports)) == len(ports)
