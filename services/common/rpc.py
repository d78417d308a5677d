"""The control plane scaffold: a grpc.aio server with health, reflection and an optional bearer token."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.logging import get_logger

OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclasses.dataclass(frozen=True)
class Servicer:
    """One gRPC service to host: the generated `add_XServicer_to_server`, the implementation and its full name."""

    add_to_server: Callable[[Any, grpc.aio.Server], None]
    implementation: Any
    full_name: str


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>`; health and reflection stay open."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(OPEN_METHODS):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if metadata.get("authorization") == self._expected:
            return await continuation(handler_call_details)
        return grpc.unary_unary_rpc_method_handler(_deny)


async def _deny(request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


class RpcServer:
    """A started grpc.aio server; `port` is the bound port, `health` sets serving status."""

    def __init__(self, server: grpc.aio.Server, port: int, health_servicer: health.aio.HealthServicer,
                 names: Sequence[str]) -> None:
        self.server = server
        self.port = port
        self.health = health_servicer
        self._names = names

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self._names):
            await self.health.set(name, status)

    async def stop(self, grace: float = 2.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)


async def start_server(address: str, servicers: Sequence[Servicer], *, auth_token: str = "") -> RpcServer:
    interceptors = [BearerTokenInterceptor(auth_token)] if auth_token else []
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [s.full_name for s in servicers]
    for s in servicers:
        s.add_to_server(s.implementation, server)
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise ValueError(f"grpc_address: cannot bind {address!r}")
    await server.start()
    rpc = RpcServer(server, port, health_servicer, names)
    await rpc.set_serving(True)
    return rpc


def bound_address(address: str, port: int) -> str:
    host = address.rsplit(":", 1)[0]
    return f"{host}:{port}"


class _TokenInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._md = ("authorization", f"Bearer {token}")

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        metadata = list(client_call_details.metadata or ()) + [self._md]
        details = client_call_details._replace(metadata=metadata)
        return await continuation(details, request)


def channel(address: str, *, token: str = "") -> grpc.aio.Channel:
    interceptors = [_TokenInterceptor(token)] if token else None
    return grpc.aio.insecure_channel(address, interceptors=interceptors, options=[
        ("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)])


async def invalid_argument(context: grpc.aio.ServicerContext, field: str, problem: str) -> None:
    """Abort the call with INVALID_ARGUMENT naming the field."""
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")


async def call_until_ok(call: Callable[[], Any], stop: asyncio.Event, *, what: str, max_delay: float = 2.0) -> bool:
    """Retry an async gRPC call while its server is not up yet; False if `stop` was set first."""
    delay = 0.2
    while not stop.is_set():
        try:
            await call()
            return True
        except (grpc.aio.AioRpcError, OSError) as exc:
            get_logger().debug("peer_not_ready", what=what, error=str(exc))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)
            delay = min(delay * 2, max_delay)
    return False
