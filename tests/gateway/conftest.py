"""Gateways on loopback for the SDK, conformance and token-exactness tests (one per module)."""

from __future__ import annotations

import pytest
import torch

from tests.gateway.harness import GatewayServer
from tests.gateway.policies import calculator_replies, random_engine, scripted_engine, tokenizer


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """As EngineConfig.build does: this thread stays at one OpenMP thread, so the engine's is the only team."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.fixture(scope="module")
def random_gw(tok):
    """The tiny random Qwen3 (it follows no instructions; it exercises the protocol)."""
    server = GatewayServer(random_engine(tok), tok, default_max_tokens=48).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def scripted_gw(tok):
    """A scripted policy that calls tools and answers, through the same engine and gateway."""
    server = GatewayServer(scripted_engine(tok, calculator_replies), tok).start()
    yield server
    server.stop()
