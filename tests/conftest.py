"""Shared fixtures: a real nats-server with JetStream per test, in a temporary store (open, or with the launcher's
per-identity users and permissions); the built-in tiny model."""

from __future__ import annotations

import pytest

from launcher.processes import NatsServer
from launcher.stack import ensure_model
from services.common.credentials import RunCredentials


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "nats")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def creds(tmp_path) -> RunCredentials:
    return RunCredentials.ensure(tmp_path / "secrets")


@pytest.fixture
def nats_with_auth(creds, tmp_path):
    """nats-server with the users and permissions the launcher generates for `creds`."""
    server = NatsServer(tmp_path / "nats", authorization=creds.nats_authorization(),
                        config_path=creds.directory / "nats.conf", log_path=tmp_path / "nats.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_qwen3():
    """artifacts/models/tiny-qwen3-seed0, as `make run` uses it (built once, ~20 s, when missing)."""
    return ensure_model("tiny-qwen3", 0)


@pytest.fixture(scope="session")
def vlm_tokenizer():
    """The tiny LLaVA's tokenizer: the tiny Qwen3's and one more special token (<image>)."""
    from services.trainer.models.tiny_vlm import build_vlm_tokenizer

    return build_vlm_tokenizer()
