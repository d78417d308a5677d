"""The whole weight exchange in one event loop, for benchmarks and tests of an engine's receiver: the service, one
sender over a dict of Hugging Face tensors (a trainer's weights) and the engine's receiver agent
(`engine.weight_receiver_args()`, hosted on a loopback gRPC server), each a real component talking gRPC and the
data plane over loopback. `exchange_service` and `hosted_receiver` alone serve senders of other processes (a
trainer's ranks)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import torch

from services.common.contracts import weight_exchange_pb2 as wx_pb2
from services.common.net import free_port
from services.common.rpc import start_server
from services.weight_exchange.client import ReceiverAgent, SenderAgent
from services.weight_exchange.config import WeightExchangeConfig
from services.weight_exchange.server import serve


@dataclasses.dataclass
class LocalExchange:
    sender: SenderAgent
    receiver: ReceiverAgent
    params: dict[str, torch.Tensor]
    timeout: float
    address: str            # the service's gRPC address

    async def update(self, version: int, change: Callable[[dict[str, torch.Tensor]], Any] | None = None, *,
                     transport: str = "", verify: bool = True) -> wx_pb2.SyncReply:
        """`change(params)` inside the sender's update bracket, then a Sync of `version` to the receiver."""
        self.sender.begin_update()
        try:
            if change is not None:
                with torch.no_grad():
                    change(self.params)
        finally:
            self.sender.end_update(version)
        # past the service's own deadline for the receivers (transfers + pause / resume): its error names who stalled
        return await self.sender.sync(version, self.timeout + 90.0, transport=transport, verify=verify)


def engine_receiver(engine: Any) -> dict[str, Any]:
    """ReceiverAgent arguments for a rollout engine: its pause / resume around updates, its version and weights."""
    return {"on_pause": engine.pause_async, "on_resume": engine.resume_async, "version": engine.version,
            **engine.weight_receiver_args()}


@contextlib.asynccontextmanager
async def exchange_service(*, timeout: float = 300.0, delta: bool = False,
                           full_every: int = 10) -> AsyncIterator[str]:
    """The weight-exchange service on a loopback port, answering when this yields its address."""
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    stop = asyncio.Event()
    # rank_ttl 0: no heartbeats run here, so registrations never expire (a case may sit idle for minutes)
    config = WeightExchangeConfig(grpc_address=address, nats_url="", metrics_port=-1, transfer_timeout=timeout,
                                  delta=delta, full_every=full_every, rank_ttl=0.0)
    service = asyncio.create_task(serve(config, stop))
    try:
        deadline = time.monotonic() + 60.0
        async with grpc.aio.insecure_channel(address) as ch:
            while True:   # the service comes up in the background
                try:
                    await asyncio.wait_for(ch.channel_ready(), 1.0)
                    break
                except (TimeoutError, grpc.aio.AioRpcError):
                    if service.done() or time.monotonic() > deadline:
                        raise TimeoutError(f"the weight exchange did not answer on {address} in 60 s") from None
        yield address
    finally:
        stop.set()
        await asyncio.wait_for(service, 60.0)


@contextlib.asynccontextmanager
async def hosted_receiver(address: str, receiver_args: dict[str, Any], *,
                          rank_id: str = "rollout-0") -> AsyncIterator[ReceiverAgent]:
    """A receiver made of `receiver_args` (ReceiverAgent's keyword arguments, e.g. `engine_receiver(engine)`),
    served on a loopback gRPC port and registered with the service at `address`."""
    receiver = ReceiverAgent(rank_id, wx_address=address, **receiver_args)
    server = await start_server("127.0.0.1:0", [receiver.servicer()])
    try:
        await receiver.register(f"127.0.0.1:{server.port}")
        yield receiver
    finally:
        await receiver.close()
        await server.stop(0)


@contextlib.asynccontextmanager
async def local_exchange(params: dict[str, torch.Tensor], receiver_args: dict[str, Any], *,
                         timeout: float = 300.0, rank_id: str = "rollout-0", delta: bool = False,
                         full_every: int = 10) -> AsyncIterator[LocalExchange]:
    """Sender over `params` (holding the receiver's version: they must equal its weights) and a receiver made of
    `receiver_args` (ReceiverAgent's keyword arguments, e.g. `engine_receiver(engine)`)."""
    async with exchange_service(timeout=timeout, delta=delta, full_every=full_every) as address:
        sender = SenderAgent("trainer-0", params, address, transports=("tcp", "shm"),
                             version=receiver_args.get("version", 0))
        try:
            await sender.open()
            await sender.register()
            async with hosted_receiver(address, receiver_args, rank_id=rank_id) as receiver:
                yield LocalExchange(sender, receiver, params, timeout, address)
        finally:
            await sender.close()
