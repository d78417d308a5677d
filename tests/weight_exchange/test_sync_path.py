"""The trainer -> rollout sync path with real processes: service, receiver process, sender in the test."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

import grpc
import nats
import pytest
import torch

from launcher.processes import NatsServer, free_port
from services.common.contracts import common_pb2, data_pb2
from services.common.contracts import weight_exchange_pb2 as wx_pb2
from services.common.contracts import weight_exchange_pb2_grpc as wx_grpc
from services.common.rpc import channel
from services.weight_exchange.client import SenderAgent
from tests.weight_exchange.tiny import perturb, tiny_qwen3

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """nats-server, the weight-exchange service and one receiver process."""
    with sync_stack(tmp_path_factory.mktemp("sync")) as running:
        yield running


@contextlib.contextmanager
def sync_stack(tmp: pathlib.Path, *receiver_args: str):
    """nats-server, the weight-exchange service and one receiver process (`receiver_args`: receiver_proc's)."""
    nats_server = NatsServer(tmp / "nats")
    nats_server.start()
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "MESHRL_WEIGHT_EXCHANGE__GRPC_ADDRESS": address,
           "MESHRL_WEIGHT_EXCHANGE__NATS_URL": nats_server.url, "MESHRL_WEIGHT_EXCHANGE__METRICS_PORT": "-1",
           "MESHRL_WEIGHT_EXCHANGE__TRANSFER_TIMEOUT": "3", "MESHRL_WEIGHT_EXCHANGE__CONTROL_TIMEOUT": "10"}
    service = subprocess.Popen([sys.executable, "-m", "services.weight_exchange"], cwd=ROOT, env=env,
                               stderr=open(tmp / "service.log", "w"))
    receiver = subprocess.Popen([sys.executable, "-m", "tests.weight_exchange.receiver_proc", "--wx", address,
                                 "--out", str(tmp / "rollout-0"), *receiver_args], cwd=ROOT,
                                stderr=open(tmp / "receiver.log", "w"))
    try:
        deadline = time.time() + 60
        while not (tmp / "rollout-0" / "events.jsonl").exists():
            assert service.poll() is None, (tmp / "service.log").read_text()
            assert receiver.poll() is None, (tmp / "receiver.log").read_text()
            assert time.time() < deadline, "receiver did not register"
            time.sleep(0.1)
        yield {"address": address, "out": tmp / "rollout-0", "nats": nats_server, "tmp": tmp}
    finally:
        for proc in (receiver, service):
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            if proc.poll() is None:
                proc.kill()
        nats_server.stop()


def events(out: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


async def last_deployed(url: str, version: int) -> data_pb2.VersionEvent:
    nc = await nats.connect(url)
    try:
        msg = await nc.jetstream().get_last_msg("EVENTS", "events.version")
        # the bus may namespace ids by subject ("events.version/deployed-3")
        assert (msg.headers or {}).get("Nats-Msg-Id", "").endswith(f"deployed-{version}"), msg.headers
        return data_pb2.VersionEvent.FromString(msg.data)
    finally:
        await nc.close()


@pytest.mark.parametrize("transport,version", [("tcp", 1), ("shm", 2)])
async def test_sync_moves_weights_bit_exact(stack, transport, version):
    model = tiny_qwen3(seed=0)
    perturb(model, seed=version)
    sender = SenderAgent("trainer-0", dict(model.named_parameters()), stack["address"], transports=("tcp", "shm"))
    await sender.start()
    try:
        reply = await sender.sync(version, timeout=60.0, transport=transport, verify=True)
    finally:
        await sender.close()
    assert reply.num_receivers == 1 and reply.version == version and reply.plan_hash
    expected = {k: v.detach() for k, v in model.named_parameters()}
    assert reply.bytes_moved == sum(v.numel() * v.element_size() for v in expected.values())
    got = torch.load(stack["out"] / f"v{version}.pt")
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert events(stack["out"])[-2:] == [{"kind": "pause", "version": None}, {"kind": "resume", "version": version}]
    event = await last_deployed(stack["nats"].url, version)
    assert event.version == version and event.kind == data_pb2.VERSION_KIND_DEPLOYED
    async with channel(stack["address"]) as ch:
        status = await wx_grpc.WeightExchangeServiceStub(ch).Status(common_pb2.StatusRequest())
    assert status.deployed_version == version and status.num_receivers == 1


async def test_failed_transfer_resumes_at_old_version(stack):
    model = tiny_qwen3(seed=0)
    sender = SenderAgent("trainer-0", dict(model.named_parameters()), stack["address"], transports=("tcp",))
    await sender.start()
    before = events(stack["out"])
    old = [e["version"] for e in before if e["kind"] == "resume"][-1] if any(e["kind"] == "resume" for e in before) else 0
    del sender.server.tensors["model.norm.weight"]   # the sender lost a tensor: its pull fails
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sender.sync(7, timeout=60.0, transport="tcp")
    finally:
        await sender.close()
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert "rollout-0" in err.value.details() and "trainer-0" in err.value.details()
    assert "model.norm.weight" in err.value.details()
    assert events(stack["out"])[-1] == {"kind": "resume", "version": old}


async def test_stalled_sender_times_out_and_resumes(stack):
    """A sender that accepts and never answers: the receiver gives up at the transfer timeout and resumes."""
    model = tiny_qwen3(seed=0)
    sender = SenderAgent("trainer-0", dict(model.named_parameters()), stack["address"], transports=("tcp",))
    await sender.start()
    hole = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(hole.accept()[0]), daemon=True).start()
    sender.endpoints = {"tcp": f"127.0.0.1:{hole.getsockname()[1]}"}
    await sender.register()
    try:
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sender.sync(8, timeout=60.0)
        assert time.monotonic() - start < 15
    finally:
        await sender.close()
        hole.close()
        for conn in accepted:
            conn.close()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
    assert "rollout-0" in err.value.details() and "trainer-0" in err.value.details()
    assert events(stack["out"])[-1]["kind"] == "resume" and events(stack["out"])[-1]["version"] != 8


async def test_bad_arguments_and_no_receivers(tmp_path):
    from services.weight_exchange.config import WeightExchangeConfig
    from services.weight_exchange.server import serve
    address = f"127.0.0.1:{free_port()}"
    stop = asyncio.Event()
    task = asyncio.create_task(serve(WeightExchangeConfig(grpc_address=address, nats_url="", metrics_port=-1), stop))
    try:
        await asyncio.sleep(0.3)
        model = tiny_qwen3(seed=0)
        sender = SenderAgent("trainer-0", dict(model.named_parameters()), address, transports=("tcp",))
        await sender.start()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sender.sync(1)             # the trainer may run before rollout registers: not deployed
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no receiver is registered" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sender.sync(-1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("version:")
        async with channel(address) as ch:
            stub = wx_grpc.WeightExchangeServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Register(wx_pb2.RegisterRequest(layout=data_pb2.RankLayout(role=data_pb2.RANK_ROLE_SENDER)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("layout.rank_id:")
            bad = sender.layout().to_proto()
            bad.shards[0].local_region.sizes[0] += 1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Register(wx_pb2.RegisterRequest(layout=bad))
            assert err.value.details().startswith("layout.shards[0].local_region:")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Sync(wx_pb2.SyncRequest(version=1, transport="carrier-pigeon"))
            assert err.value.details().startswith("transport:")
        await sender.close()
    finally:
        stop.set()
        await task
