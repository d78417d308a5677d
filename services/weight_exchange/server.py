"""gRPC edge of the weight-exchange service: Register, Plan, Sync, Status; Apply calls to receivers; events."""

from __future__ import annotations

import asyncio
import urllib.parse

import grpc

from services.common.auth import SHARED, Tls, caller, client_security
from services.common.contracts import weight_exchange_pb2 as wx_pb2
from services.common.contracts import weight_exchange_pb2_grpc as wx_grpc
from services.common.errors import FieldError, field_error
from services.common.logging import get_logger
from services.common.rpc import (
    LARGE_MAX_RECEIVE,
    Servicer,
    bound_address,
    channel,
    invalid_argument,
)
from services.common.runtime import ServiceRuntime
from services.weight_exchange.announce import DeployedAnnouncer
from services.weight_exchange.client.layout import RECEIVER, SENDER, RankLayout
from services.weight_exchange.config import WeightExchangeConfig
from services.weight_exchange.coordinator import ApplyError, Coordinator, RegisterDenied, SyncError
from services.weight_exchange.planner import PlanError

log = get_logger()


class AgentClients:
    """One channel per receiver agent address."""

    def __init__(self, token: str, tls: Tls | None = None) -> None:
        self.token = token
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def apply(self, receiver: RankLayout, request: wx_pb2.ApplyRequest, timeout: float) -> wx_pb2.ApplyReply:
        ch = self._channels.get(receiver.agent_address)
        if ch is None:
            ch = self._channels[receiver.agent_address] = channel(receiver.agent_address, token=self.token,
                                                                              tls=self.tls)
        try:
            return await wx_grpc.WeightAgentServiceStub(ch).Apply(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
            if code == "UNAVAILABLE":   # a restarted agent: reconnect at once next time, not after gRPC's back-off
                self._channels.pop(receiver.agent_address, None)
                await ch.close()
            details = exc.details() or ""
            if code == "DEADLINE_EXCEEDED" and details.lower() == "deadline exceeded":
                details = f"no answer from {receiver.agent_address} within {timeout:.0f}s"
            raise ApplyError(code, f"{code}: {details}") from exc

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()


def peer_ip(peer: str) -> str:
    """gRPC's peer string ("ipv4:10.0.0.5:43210", "ipv6:%5B::1%5D:43210") -> the IP ("" for other kinds)."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    host = rest.rsplit(":", 1)[0]
    return host.strip("[]")


async def agent_is_caller(agent_address: str, peer: str) -> bool:
    """True when `agent_address`'s host is (or resolves to) the IP the Register call came from."""
    ip = peer_ip(peer)
    host = agent_address.rsplit(":", 1)[0].strip("[]")
    if not ip or not host:
        return False
    if host == ip:
        return True
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None)
    except OSError:
        return False
    resolved = {info[4][0] for info in infos}
    loopback = {"127.0.0.1", "::1"}
    return ip in resolved or (ip in loopback and bool(resolved & loopback))


class WeightExchangeServicer(wx_grpc.WeightExchangeServiceServicer):
    def __init__(self, coordinator: Coordinator, roles: dict[str, tuple[str, ...]] | None = None, *,
                 check_agent_address: bool = True) -> None:
        self.coordinator = coordinator
        self.check_agent_address = check_agent_address
        self.roles = roles or {SENDER: ("trainer",), RECEIVER: ("rollout",)}  # role -> identities that may take it

    async def Register(self, request, context):  # noqa: N802
        if not request.HasField("layout"):
            await invalid_argument(context, "layout", "required")
        identity = caller()  # None: this server checks no token
        layout = RankLayout.from_proto(request.layout)
        if identity not in (None, SHARED) and identity not in self.roles.get(layout.role, ()):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{identity} may not register a "
                                f"{layout.role or 'rank of unknown role'} rank")
        if (identity is not None and self.check_agent_address and layout.role == RECEIVER
                and not await agent_is_caller(layout.agent_address, context.peer())):
            # the service dials agent_address with its own token: only the registering peer's own address
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"agent_address: {layout.agent_address!r} is "
                                f"not an address of the registering peer ({context.peer()})")
        try:
            self.coordinator.register(layout, key=request.rank_key, owner=identity)
        except RegisterDenied as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except ValueError as exc:
            await invalid_argument(context, field_error(exc) or FieldError("request", str(exc)))
        c = self.coordinator
        return wx_pb2.RegisterReply(rank_id=request.layout.rank_id, num_senders=len(c.senders),
                                    num_receivers=len(c.receivers), sender_version=c.sender_version)

    async def Plan(self, request, context):  # noqa: N802
        try:
            self.coordinator.check_transport(request.transport)
            return self.coordinator.plan_reply(request.include_transfers)
        except PlanError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"plan: {exc}")
        except ValueError as exc:
            await invalid_argument(context, field_error(exc) or FieldError("request", str(exc)))

    async def Sync(self, request, context):  # noqa: N802
        try:
            r = await self.coordinator.sync(request.version, request.transport, request.verify or None)
        except SyncError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code, grpc.StatusCode.ABORTED), str(exc))
        except ValueError as exc:
            await invalid_argument(context, field_error(exc) or FieldError("request", str(exc)))
        return wx_pb2.SyncReply(version=r.version, seconds=r.seconds, bytes_moved=r.bytes_moved,
                                num_receivers=r.num_receivers, plan_hash=r.plan_hash, delta=r.delta,
                                bytes_full=r.bytes_full)

    async def Status(self, request, context):  # noqa: N802
        c = self.coordinator
        c.expire()
        return wx_pb2.WeightExchangeStatus(num_senders=len(c.senders), num_receivers=len(c.receivers),
                                           deployed_version=c.deployed_version, syncs=c.syncs,
                                           last_sync_seconds=c.last_sync_seconds, last_bytes_moved=c.last_bytes_moved)


async def serve(config: WeightExchangeConfig, stop: asyncio.Event) -> None:
    async with ServiceRuntime(config, stop) as runtime:
        bus = await runtime.connect_bus("weight_exchange") if config.publish_events and config.nats_url else None
        # one active instance (the registrations live in its memory): a second one waits here as a standby until
        # the active one's lease is released or lapses. Without NATS there is no lease: run one instance only.
        if bus is not None and await runtime.hold_lease(bus, "weight_exchange") is None:
            return
        announcer = DeployedAnnouncer(bus) if bus is not None else None
        if announcer is not None:
            runtime.spawn(announcer.run(stop), "deployed-announcer")

        async def deployed(version: int) -> None:
            if announcer is not None:
                await announcer.deployed(version)

        client = client_security(config)
        agents = AgentClients(config.agent_token or client["token"], client["tls"])
        runtime.on_close(agents.close)
        coordinator = Coordinator(apply=agents.apply, on_deployed=deployed, bucket_bytes=config.bucket_bytes,
                                  default_transport=config.default_transport,
                                  transfer_timeout=config.transfer_timeout, control_timeout=config.control_timeout,
                                  verify=config.verify, rank_ttl=config.rank_ttl, delta=config.delta,
                                  full_every=config.full_every)
        runtime.on_close(coordinator.close)
        roles = {SENDER: tuple(config.sender_identities), RECEIVER: tuple(config.receiver_identities)}
        servicer = Servicer(wx_grpc.add_WeightExchangeServiceServicer_to_server, WeightExchangeServicer(
            coordinator, roles, check_agent_address=config.check_agent_address),
                            wx_pb2.DESCRIPTOR.services_by_name["WeightExchangeService"].full_name)
        server = await runtime.serve_grpc([servicer], max_receive_bytes=LARGE_MAX_RECEIVE)  # large models' layouts
        log.info("serving", address=bound_address(config.grpc_address, server.port))
        await runtime.until_stopped()
