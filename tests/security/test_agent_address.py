"""F20: the weight exchange dials a receiver's agent_address with its own bearer token, so a token holder may
register only its own address: a rollout replica can no longer point the service (and its token) at a listener
of its choosing, nor at an arbitrary host:port."""

from __future__ import annotations

import grpc

from services.common.auth import server_security
from services.common.contracts import weight_exchange_pb2 as wx_pb2
from services.common.contracts import weight_exchange_pb2_grpc as wx_grpc
from services.common.rpc import Servicer, start_server
from services.weight_exchange.client.layout import RECEIVER, RankLayout
from services.weight_exchange.client.layouts.hf import hf_full_shards
from services.weight_exchange.coordinator import Coordinator
from services.weight_exchange.server import WeightExchangeServicer, agent_is_caller, peer_ip
from tests.security.test_auth_matrix import config_of, tiny_params

RANK_KEY = "00" * 32


async def register(port: int, token: str, agent_address: str) -> grpc.StatusCode:
    layout = RankLayout("rollout-0", RECEIVER, "hf", hf_full_shards(tiny_params()), agent_address=agent_address)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            await wx_grpc.WeightExchangeServiceStub(ch).Register(
                wx_pb2.RegisterRequest(layout=layout.to_proto(), rank_key=RANK_KEY),
                metadata=(("authorization", f"Bearer {token}"),), timeout=10)
        except grpc.aio.AioRpcError as exc:
            assert "agent_address" in (exc.details() or ""), exc.details()
            return exc.code()
    return grpc.StatusCode.OK


async def test_a_receiver_may_register_only_its_own_address(creds):  # noqa: F811
    server = await start_server("127.0.0.1:0", [Servicer(
        wx_grpc.add_WeightExchangeServiceServicer_to_server, WeightExchangeServicer(Coordinator(apply=None, rank_ttl=0)),
        "meshrl.v1.WeightExchangeService")], security=server_security(config_of(creds, "weight_exchange")))
    token = creds.token("rollout")
    try:
        assert await register(server.port, token, "10.99.0.7:50051") == grpc.StatusCode.PERMISSION_DENIED
        assert await register(server.port, token, "example.invalid:50051") == grpc.StatusCode.PERMISSION_DENIED
        assert await register(server.port, token, "127.0.0.1:50051") == grpc.StatusCode.OK
        assert await register(server.port, token, "localhost:50051") == grpc.StatusCode.OK
    finally:
        await server.stop(0)


async def test_peer_strings_are_parsed():
    assert peer_ip("ipv4:10.0.0.5:43210") == "10.0.0.5"
    assert peer_ip("ipv6:%5B::1%5D:43210") == "::1"
    assert peer_ip("unix:/tmp/x") == ""
    assert await agent_is_caller("10.0.0.5:1", "ipv4:10.0.0.5:9") and not await agent_is_caller("10.0.0.6:1",
                                                                                              "ipv4:10.0.0.5:9")
