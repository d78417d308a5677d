"""Restarts on the weight path: the service, a receiver and a sender restart; reads are never torn.

Real gRPC servers and data sockets on loopback; the service runs in the test's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
import torch

from launcher.processes import free_port
from services.common.contracts import common_pb2
from services.common.contracts import weight_exchange_pb2_grpc as wx_grpc
from services.common.rpc import channel, start_server
from services.weight_exchange.client import ReceiverAgent, SenderAgent
from services.weight_exchange.client.layout import RECEIVER, SENDER, RankLayout
from services.weight_exchange.client.layouts.hf import hf_full_shards
from services.weight_exchange.client.sink import pull_all
from services.weight_exchange.client.source import SenderServer
from services.weight_exchange.client.transports.tcp import TcpTransport
from services.weight_exchange.client.wire import TransportError
from services.weight_exchange.config import WeightExchangeConfig
from services.weight_exchange.planner import plan
from services.weight_exchange.server import serve
from tests.weight_exchange.tiny import perturb, tiny_qwen3

HEARTBEAT = 0.2


def weights(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in tiny_qwen3(seed=seed).named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@contextlib.asynccontextmanager
async def service(address: str):
    stop = asyncio.Event()
    config = WeightExchangeConfig(grpc_address=address, nats_url="", metrics_port=-1, transfer_timeout=10.0,
                                  control_timeout=10.0)
    task = asyncio.create_task(serve(config, stop))
    try:
        yield
    finally:
        stop.set()
        await task


@contextlib.asynccontextmanager
async def receiving(address: str, params: dict[str, torch.Tensor], version: int = 0):
    agent = ReceiverAgent("rollout-0", params, address, version=version)
    server = await start_server("127.0.0.1:0", [agent.servicer()])
    stop = asyncio.Event()
    beat = asyncio.create_task(agent.keep_registered(stop, HEARTBEAT, agent_address=f"127.0.0.1:{server.port}"))
    try:
        yield agent
    finally:
        stop.set()
        await beat
        await agent.close()
        await server.stop(0)


@contextlib.asynccontextmanager
async def sending(address: str, params: dict[str, torch.Tensor], version: int):
    agent = SenderAgent("trainer-0", params, address, transports=("tcp",), version=version)
    await agent.open()
    stop = asyncio.Event()
    beat = asyncio.create_task(agent.keep_registered(stop, HEARTBEAT))
    try:
        yield agent
    finally:
        stop.set()
        await beat
        await agent.close()


async def eventually(check, timeout: float = 20.0):
    """`await check()` until it stops raising (gRPC errors) or `timeout` passes."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await check()
        except grpc.aio.AioRpcError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


async def registered(agent, timeout: float = 30.0) -> None:
    """Until `agent`'s registration succeeded; AssertionError naming the rank and its last reply past `timeout`."""
    try:
        await asyncio.wait_for(agent.registered.wait(), timeout)
    except TimeoutError:
        raise AssertionError(f"{agent.rank_id} not registered within {timeout:g}s "
                             f"(last reply: {agent.last_reply})") from None


async def status(address: str):
    async with channel(address) as ch:
        return await wx_grpc.WeightExchangeServiceStub(ch).Status(common_pb2.StatusRequest(), timeout=5)


async def test_agents_re_register_after_a_service_restart():
    address = f"127.0.0.1:{free_port()}"
    trained, live = weights(0), weights(1)
    async with sending(address, trained, version=0) as sender, receiving(address, live):
        async with service(address):     # the agents started first: they retry until the service is up
            assert (await eventually(lambda: sender.sync(0, timeout=30))).num_receivers == 1
        assert same(live, trained)
        sender.begin_update()
        perturb_dict(trained, 1)
        sender.end_update(1)
        async with service(address):     # restarted on the same port, with no registrations
            reply = await eventually(lambda: sender.sync(1, timeout=30))
            assert reply.num_receivers == 1 and reply.version == 1
            assert (await status(address)).deployed_version == 1
        assert same(live, trained)


async def test_restarted_receiver_and_sender():
    """A receiver that comes back at version 0 is caught up to the senders' version (on a heartbeat); a sender that
    comes back (new endpoints, its checkpoint's version) replaces its old registration."""
    address = f"127.0.0.1:{free_port()}"
    trained = weights(0)
    perturb_dict(trained, 2)
    async with service(address):
        async with receiving(address, weights(1), version=2) as old:
            await registered(old)
        fresh = weights(1)
        async with receiving(address, fresh) as receiver:     # restarted: initial weights, version 0
            async with sending(address, trained, version=2):
                for _ in range(400):
                    if receiver.version == 2:
                        break
                    await asyncio.sleep(0.05)
                assert receiver.version == 2 and same(fresh, trained)
                assert receiver.last_reply.sender_version == 2
                assert (await status(address)).deployed_version == 2
            async with sending(address, trained, version=2) as restarted:   # the trainer, from its checkpoint
                restarted.begin_update()
                perturb_dict(trained, 3)
                restarted.end_update(3)
                await registered(restarted)
                reply = await eventually(lambda: restarted.sync(3, timeout=30))
                assert reply.version == 3 and receiver.version == 3 and same(fresh, trained)


async def test_a_read_during_an_update_aborts_the_apply_naming_the_sender():
    address = f"127.0.0.1:{free_port()}"
    trained, live = weights(0), weights(1)
    async with service(address), sending(address, trained, version=0) as sender, receiving(address, live) as r:
        await registered(sender)
        await registered(r)
        sender.begin_update()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sender.sync(1, timeout=30)
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert "trainer-0" in err.value.details() and "being updated" in err.value.details()
        assert r.version == 0
        perturb_dict(trained, 1)
        sender.end_update(1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sender.sync(2, timeout=30)                   # the sender holds 1, not 2
        assert err.value.code() == grpc.StatusCode.ABORTED and "holds 1, not the requested 2" in err.value.details()
        await sender.sync(1, timeout=30)
        assert r.version == 1 and same(live, trained)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sender.sync(0, timeout=30)                   # an older version than the sender holds: refused by it
        assert err.value.code() == grpc.StatusCode.ABORTED and "holds 1, not the requested 0" in err.value.details()
        assert r.version == 1 and same(live, trained)


def perturb_dict(params: dict[str, torch.Tensor], seed: int) -> None:
    module = torch.nn.Module()
    for i, t in enumerate(params.values()):
        module.register_parameter(f"p{i}", torch.nn.Parameter(t, requires_grad=False))
    perturb(module, seed)


def pull(server: SenderServer, into: dict[str, torch.Tensor], endpoint: str, version: int):
    src = RankLayout(server.rank_id, SENDER, "hf", hf_full_shards(server.tensors), endpoints={"tcp": endpoint})
    dst = RankLayout("rollout-0", RECEIVER, "hf", hf_full_shards(into), agent_address="-")
    return pull_all("rollout-0", into, plan([src], [dst]).transfers, {server.rank_id: endpoint}, "tcp", 10.0,
                    version=version)


def test_sender_server_refuses_reads_during_an_update_and_of_another_version(monkeypatch):
    params, into = weights(0), weights(1)
    server = SenderServer("trainer-0", params)
    endpoint = server.start()["tcp"]
    try:
        server.end_update(3)
        assert pull(server, into, endpoint, 3).bytes_received > 0 and same(into, params)
        server.begin_update()
        with pytest.raises(TransportError, match="sender trainer-0: parameters are being updated"):
            pull(server, into, endpoint, 3)
        server.end_update(4)
        with pytest.raises(TransportError, match="sender trainer-0: version: holds 4, not the requested 3"):
            pull(server, into, endpoint, 3)
        serve_tcp = TcpTransport.serve

        def step_during_the_read(self, conn, request, views, srv):
            serve_tcp(self, conn, request, views, srv)
            srv.begin_update()           # a training step starts while the receiver is still reading
            srv.end_update(5)

        monkeypatch.setattr(TcpTransport, "serve", step_during_the_read)
        with pytest.raises(TransportError, match=r"trainer-0: parameters changed while version 4 was read \(torn"):
            pull(server, into, endpoint, 4)
        monkeypatch.undo()
        assert pull(server, into, endpoint, 5).bytes_received > 0
        with pytest.raises(ValueError, match="^version:"):
            server.end_update(-1)
    finally:
        server.stop()


def test_untracked_sender_serves_any_version():
    params, into = weights(0), weights(1)
    server = SenderServer("trainer-0", params)
    endpoint = server.start()["tcp"]
    try:
        assert server.version is None
        pull(server, into, endpoint, 17)
        assert same(into, params)
    finally:
        server.stop()


def test_a_pull_casts_into_live_parameters_that_require_grad():
    """The pulling threads write outside autograd themselves (grad mode is per thread): live bf16 parameters that
    require grad take a float32 sender's values through the staging path (a cast), as an engine's model does."""
    params = weights(0)
    server = SenderServer("trainer-0", params)
    endpoint = server.start()["tcp"]
    live = {k: torch.nn.Parameter(v.to(torch.bfloat16) * 0, requires_grad=True) for k, v in weights(1).items()}
    try:
        server.end_update(1)
        assert pull(server, live, endpoint, 1).bytes_received > 0
        assert all(torch.equal(live[k].detach(), params[k].to(torch.bfloat16)) for k in params)
        assert all(p.requires_grad and p.grad_fn is None for p in live.values())
    finally:
        server.stop()
