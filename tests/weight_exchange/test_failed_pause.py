"""F23: a weight update whose pause fails (the engine did not stand still in time) must not resume the engine:
the failed pause left nothing behind, and a resume would undo another pause, an operator's Pause."""

from __future__ import annotations

import asyncio

import pytest

from services.common.contracts import weight_exchange_pb2 as wx_pb2
from services.weight_exchange.client import ReceiverAgent
from services.weight_exchange.client.agents import _ApplyFailed
from tests.rollout.test_engine import make_engine, tiny_model


async def test_a_failed_update_pause_leaves_an_operators_pause_in_force():
    engine = make_engine(tiny_model(1))
    try:
        await engine.pause_async(timeout=30)  # the operator's Pause
        assert engine.paused

        async def failing_pause() -> None:  # the update's own pause times out
            raise TimeoutError("engine did not pause within 0.1s")

        agent = ReceiverAgent("rollout-0", engine.named_parameters(), "127.0.0.1:1", on_pause=failing_pause,
                              on_resume=engine.resume_async)
        with pytest.raises(_ApplyFailed, match="pause failed"):
            await agent._apply(wx_pb2.ApplyRequest(version=1), [])
        await asyncio.sleep(0.2)
        assert engine.paused and engine._pause_requests == 1  # still the operator's
    finally:
        engine.stop()
