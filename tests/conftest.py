"""Shared fixtures: a real nats-server with JetStream per test, in a temporary store."""

from __future__ import annotations

import pytest

from launcher.processes import NatsServer


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "nats")
    server.start()
    yield server
    server.stop()
