"""An Apply whose caller goes away mid-update (a restarted trainer cancels its Sync) still resumes the engine."""

from __future__ import annotations

import asyncio

import torch

from services.common.contracts import weight_exchange_pb2 as wx_pb2
from services.weight_exchange.client import ReceiverAgent
from services.weight_exchange.client.tickets import sign_apply


class Engine:
    def __init__(self) -> None:
        self.pauses = 0
        self.resumes: list[int] = []
        self.pausing = asyncio.Event()

    async def pause(self) -> None:
        self.pauses += 1
        self.pausing.set()
        await asyncio.sleep(0.3)  # the engine reaches a step boundary while the caller gives up

    async def resume(self, version: int) -> None:
        self.resumes.append(version)


async def test_cancelled_apply_still_resumes_the_paused_engine():
    engine = Engine()
    agent = ReceiverAgent("rollout-0", {"w": torch.zeros(4)}, "127.0.0.1:1", on_pause=engine.pause,
                          on_resume=engine.resume, version=3)
    request = wx_pb2.ApplyRequest(version=4, transport="tcp", timeout_seconds=5.0,  # no transfers: nothing to pull
                                  sync_id="sync-1")
    sign_apply(agent.key, request)  # as the coordinator this agent registered with does
    call = asyncio.create_task(agent.apply(request, context=None))
    await asyncio.wait_for(engine.pausing.wait(), 10)  # an apply that fails before pausing fails here, not hangs
    call.cancel()  # the RPC is cancelled between pause and resume
    await asyncio.sleep(0.6)
    assert engine.pauses == 1 and engine.resumes == [4], "every pause is undone"
    assert agent.version == 4
    await agent.close()
