"""The control plane scaffold: a grpc.aio server with health, reflection, bearer tokens with a per-method allow-list
of identities (services.common.auth) and optional TLS / mTLS; channels that present a token."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.auth import CALLER, OPEN_METHODS, AuthError, ServerSecurity, Tls, TokenTable, allowed, is_loopback
from services.common.errors import FieldError
from services.common.logging import get_logger
from services.common.runtime import Backoff, sleep_or_stop

MESSAGE_LIMITS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]
# what a server accepts before its interceptor checks the token (grpc reads a unary request whole first): small
# unless the service takes large requests (the weight plane's layouts and plans: WX and the receivers' agents)
DEFAULT_MAX_RECEIVE = 16 << 20
LARGE_MAX_RECEIVE = 256 << 20


@dataclasses.dataclass(frozen=True)
class Servicer:
    """One gRPC service to host: the generated `add_XServicer_to_server`, the implementation and its full name."""

    add_to_server: Callable[[Any, grpc.aio.Server], None]
    implementation: Any
    full_name: str


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Accepts a call when `authorization: Bearer <token>` names an identity allowed to call the method
    (UNAUTHENTICATED / PERMISSION_DENIED otherwise); health and reflection stay open. The handler sees the
    identity through `services.common.auth.caller()`."""

    def __init__(self, tokens: TokenTable, policy, open_methods: tuple[str, ...] = OPEN_METHODS) -> None:
        self._tokens = tokens
        self._policy = policy
        self._open = open_methods

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(self._open):
            return await continuation(handler_call_details)
        token = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
                token = value[len("Bearer "):]
        identity = self._tokens.identify(token) if token else None
        if identity is None:
            return grpc.unary_unary_rpc_method_handler(_deny(grpc.StatusCode.UNAUTHENTICATED,
                                                             "missing or wrong bearer token"))
        if not allowed(identity, method, self._policy):
            return grpc.unary_unary_rpc_method_handler(_deny(grpc.StatusCode.PERMISSION_DENIED,
                                                             f"{identity} may not call {method}"))
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        return handler._replace(unary_unary=_as(identity, handler.unary_unary))


def _as(identity: str, behavior):
    async def call(request, context):
        reset = CALLER.set(identity)
        try:
            return await behavior(request, context)
        finally:
            CALLER.reset(reset)

    return call


def _deny(code: grpc.StatusCode, message: str):
    async def deny(request, context: grpc.aio.ServicerContext):
        await context.abort(code, message)

    return deny


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


async def start_server(address: str, servicers: Sequence[Servicer], *, auth_token: str = "",
                       security: ServerSecurity | None = None, max_receive_bytes: int = DEFAULT_MAX_RECEIVE) -> RpcServer:
    """Serve `servicers` on `address`. `security` (see services.common.auth.server_security) sets the tokens, the
    allow-list, TLS and reflection; `auth_token` alone is one token allowed everything. Without a token the
    address must be loopback."""
    security = security or ServerSecurity()
    if security.tokens is None and auth_token:
        security = dataclasses.replace(security, tokens=TokenTable.from_tokens({"shared": auth_token}))
    host = address.rsplit(":", 1)[0]
    if security.tokens is None and not is_loopback(host):
        raise AuthError(f"grpc_address: {address} is not a loopback address; refusing to serve it without a token "
                        "(set auth_token_file and auth_peers_file, or auth_token)")
    interceptors = [BearerTokenInterceptor(security.tokens, security.policy)] if security.tokens else []
    if security.tokens is None and servicers:  # loopback only, but any local user may call every method
        get_logger().warning("grpc_unauthenticated", address=address, services=[s.full_name for s in servicers],
                             reason="no token configured: every local user may call Pause, Checkpoint, Generate "
                                    "(set auth_token_file and auth_peers_file; make run / up do)")
    options = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", max_receive_bytes)]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [s.full_name for s in servicers]
    for s in servicers:
        s.add_to_server(s.implementation, server)
    if security.reflection:
        reflection.enable_server_reflection(
            (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    if security.tls is not None:
        port = server.add_secure_port(address, security.tls.server_credentials())
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise FieldError("grpc_address", f"cannot bind {address!r}")
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


def channel(address: str, *, token: str = "", tls: Tls | None = None) -> grpc.aio.Channel:
    """A channel that sends `authorization: Bearer <token>` on every call; over TLS when `tls` is given."""
    interceptors = [_TokenInterceptor(token)] if token else None
    if tls is None:
        return grpc.aio.insecure_channel(address, interceptors=interceptors, options=MESSAGE_LIMITS)
    options = [*MESSAGE_LIMITS, *([("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else [])]
    return grpc.aio.secure_channel(address, tls.channel_credentials(), interceptors=interceptors, options=options)


async def invalid_argument(context: grpc.aio.ServicerContext, error: FieldError | str, problem: str = "") -> None:
    """Abort the call with INVALID_ARGUMENT naming the field: a FieldError, or a field and its problem."""
    if isinstance(error, str):
        error = FieldError(error, problem)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))


async def call_until_ok(call: Callable[[], Any], stop: asyncio.Event, *, what: str, max_delay: float = 2.0) -> bool:
    """Retry an async gRPC call while its server is not up yet; False if `stop` was set first."""
    backoff = Backoff(initial=0.2, cap=max_delay)
    while not stop.is_set():
        try:
            await call()
            return True
        except (grpc.aio.AioRpcError, OSError) as exc:
            get_logger().debug("peer_not_ready", what=what, error=str(exc))
            await sleep_or_stop(stop, backoff.next())
    return False
