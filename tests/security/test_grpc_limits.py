"""F19: a gRPC server reads a unary request whole before its interceptor checks the token, so what it accepts
unauthenticated is bounded by its receive limit: 16 MiB, except where large requests are the service's job (the
weight plane: 256 MiB)."""

from __future__ import annotations

import grpc
import pytest

from services.common.rpc import DEFAULT_MAX_RECEIVE, LARGE_MAX_RECEIVE, start_server


async def send(port: int, size: int) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_send_message_length", 64 << 20)]) as ch:
        call = ch.unary_unary("/meshrl.v1.BuilderService/Status", request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
        try:
            await call(b"x" * size, timeout=30)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("limit", [DEFAULT_MAX_RECEIVE, LARGE_MAX_RECEIVE])
async def test_an_unauthenticated_request_over_the_receive_limit_is_refused_before_it_is_read(limit):
    server = await start_server("127.0.0.1:0", [], auth_token="secret-token", max_receive_bytes=limit)
    try:
        code = await send(server.port, 20 << 20)
        # over 16 MiB: refused as too large; under the weight plane's limit: read, then refused for the token
        assert code == (grpc.StatusCode.RESOURCE_EXHAUSTED if limit == DEFAULT_MAX_RECEIVE
                        else grpc.StatusCode.UNAUTHENTICATED)
    finally:
        await server.stop(0)
