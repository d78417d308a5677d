"""Shared fixtures: a real nats-server with JetStream per test, in a temporary store; the built-in tiny model."""

from __future__ import annotations

import pytest

from launcher.processes import NatsServer
from launcher.stack import ensure_model


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "nats")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_qwen3():
    """artifacts/models/tiny-qwen3-seed0, as `make run` uses it (built once, ~20 s, when missing)."""
    return ensure_model("tiny-qwen3", 0)
