"""Sender agent (inside trainer ranks) and receiver agent (inside inference ranks)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
import torch

from services.common.auth import Tls
from services.common.contracts import weight_exchange_pb2 as wx_pb2
from services.common.contracts import weight_exchange_pb2_grpc as wx_grpc
from services.common.errors import FieldError
from services.common.logging import get_logger
from services.common.rpc import Servicer, channel, invalid_argument
from services.common.runtime import Backoff, sleep_or_stop
from services.weight_exchange.client import tickets
from services.weight_exchange.client.layout import POST_LOAD_TRANSFORMED, RECEIVER, SENDER, RankLayout, Shard
from services.weight_exchange.client.layouts.hf import dedupe_tied, hf_full_shards
from services.weight_exchange.client.sink import PullJob, PullResult
from services.weight_exchange.client.source import SenderServer
from services.weight_exchange.client.transfer import Transfer
from services.weight_exchange.client.wire import TransferTimeout, TransportError, torch_dtype

log = get_logger()


class _Client:
    """A lazily opened channel to the weight-exchange service; one that found the service unavailable is dropped,
    so the next call connects at once instead of after gRPC's reconnect back-off (minutes after a long restart)."""

    def __init__(self, wx_address: str, token: str, tls: Tls | None = None) -> None:
        self.wx_address = wx_address
        self.token = token
        self.tls = tls
        self._channel: grpc.aio.Channel | None = None

    @property
    def stub(self) -> wx_grpc.WeightExchangeServiceStub:
        if self._channel is None:
            self._channel = channel(self.wx_address, token=self.token, tls=self.tls)
        return wx_grpc.WeightExchangeServiceStub(self._channel)

    async def call(self, method: str, request: Any, timeout: float) -> Any:
        try:
            return await getattr(self.stub, method)(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                await self.close()
            raise

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


class _Registrant:
    """A rank that keeps itself registered: its heartbeats re-register it after a restart of the service."""

    rank_id: str
    key: bytes                              # this process's secret with the coordinator (tickets.py)
    registered: asyncio.Event               # set once a registration succeeded
    last_reply: wx_pb2.RegisterReply | None
    _registry: _Client                      # its own channel: a heartbeat never disturbs a Sync in flight

    async def register(self) -> wx_pb2.RegisterReply:
        raise NotImplementedError

    async def keep_registered(self, stop: asyncio.Event, interval: float = 5.0) -> None:
        """Register, then re-register every `interval` seconds until `stop` is set (the service drops a rank
        silent for its `rank_ttl`). gRPC errors are logged and retried with back-off; a layout the service
        rejects (INVALID_ARGUMENT) raises."""
        if interval <= 0:
            raise FieldError("interval", f"must be positive, got {interval}")
        backoff, failures = Backoff(initial=min(0.2, interval), cap=interval), 0
        while not stop.is_set():
            try:
                await self.register()
                wait, failures = interval, 0
                backoff.reset()
            except (grpc.aio.AioRpcError, OSError) as exc:
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                failures += 1
                wait = backoff.next()
                (log.warning if failures == 1 else log.debug)(
                    "register_failed", rank_id=self.rank_id, error=str(exc), retry_in=round(wait, 2))
            await sleep_or_stop(stop, wait)

    async def _send(self, layout: RankLayout) -> wx_pb2.RegisterReply:
        layout.validate()
        request = wx_pb2.RegisterRequest(layout=layout.to_proto(), rank_key=self.key.hex())
        reply = await self._registry.call("Register", request, 30.0)
        self.last_reply = reply
        self.registered.set()
        return reply


class SenderAgent(_Registrant):
    """Serves this trainer rank's parameters to receivers and asks the service for updates.

    `params` maps local names to tensors (for a plain HF model: canonical names, full tensors); `shards`
    describes them (default: a full HF model on one rank). `version` is the version the parameters hold;
    bracket every change of them with `begin_update()` / `end_update(version)` so no read is torn
    (version None: not tracked, any version is served, and the parameters must not change during a sync).
    """

    def __init__(self, rank_id: str, params: Mapping[str, torch.Tensor], wx_address: str, token: str = "",
                 transports: Sequence[str] = ("tcp", "shm"), host: str = "127.0.0.1", *,
                 shards: Sequence[Shard] | None = None, framework: str = "hf",
                 parallel: Mapping[str, int] | None = None, version: int | None = None,
                 tls: Tls | None = None) -> None:
        self.rank_id = rank_id
        self.key = tickets.new_key()       # the data server serves only pulls with a ticket made with it
        self.params = dedupe_tied(params)
        self.shards = list(shards) if shards is not None else hf_full_shards(self.params)
        self.framework = framework
        self.parallel = dict(parallel or {})
        self.host = host
        self.server = SenderServer(rank_id, self.params, host, tuple(transports), key=self.key)
        if version is not None:
            self.server.end_update(version)
        self.endpoints: dict[str, str] = {}
        self.registered = asyncio.Event()
        self.last_reply = None
        self._client = _Client(wx_address, token, tls)
        self._registry = _Client(wx_address, token, tls)

    @property
    def version(self) -> int | None:
        return self.server.version

    def begin_update(self) -> None:
        """Call right before a training step mutates the parameters (any thread): reads are refused until
        `end_update`, and a read that was running fails instead of delivering torn weights."""
        self.server.begin_update()

    def end_update(self, version: int) -> None:
        """Call after the step (any thread): the parameters now hold `version`."""
        self.server.end_update(version)

    def layout(self) -> RankLayout:
        version = self.server.version
        return RankLayout(self.rank_id, SENDER, self.framework, self.shards, self.parallel,
                          endpoints=self.endpoints, host=self.host, version=-1 if version is None else version)

    async def start(self) -> None:
        """Open the data endpoints and register this rank's layout (role SENDER)."""
        await self.open()
        await self.register()

    async def open(self) -> None:
        """Open the data endpoints (register separately, e.g. retrying until the service is up)."""
        self.endpoints = await asyncio.to_thread(self.server.start)

    async def register(self) -> wx_pb2.RegisterReply:
        """Register (or re-register) this rank's layout, with the version its parameters hold."""
        return await self._send(self.layout())

    async def sync(self, version: int, timeout: float = 60.0, *, transport: str = "",
                   verify: bool = False) -> wx_pb2.SyncReply:
        """Ask the service to deploy `version`; returns once every receiver has it (raises grpc.aio.AioRpcError)."""
        request = wx_pb2.SyncRequest(version=version, transport=transport, verify=verify)
        return await self._client.call("Sync", request, timeout)

    async def plan(self, transport: str = "", include_transfers: bool = False) -> wx_pb2.PlanReply:
        request = wx_pb2.PlanRequest(transport=transport, include_transfers=include_transfers)
        return await self._client.call("Plan", request, 60.0)

    async def close(self) -> None:
        await asyncio.to_thread(self.server.stop)
        await self._client.close()
        await self._registry.close()


class ReceiverAgent(_Registrant):
    """Receives updates into the live tensors of an inference rank (in place, under torch.no_grad).

    `on_pause()` returns once generation is paused at a decode boundary; `on_resume(version)` rebuilds the
    KV cache and continues. A failed or timed-out update resumes at the old version.

    `load_weights` (e.g. vLLM's `model.load_weights`): the engine rearranges its weights after loading in a private
    format, so no raw bytes may be written into them. The layout is then registered as post-load transformed; each
    update pulls whole checkpoint tensors into staging buffers and calls `load_weights([(canonical name, tensor)])`.

    `pull` (with `shards`, no `params`): the bytes land in another process, e.g. an engine's own workers, each
    pulling its shard into its live parameters. This agent then keeps the control plane (registration, the signed
    Apply, pause and resume) and hands each update's `PullJob` to `pull`, which returns once every byte landed
    (TransportError / TransferTimeout / ValueError as a local pull raises them).
    """

    def __init__(self, rank_id: str, params: Mapping[str, torch.Tensor], wx_address: str, token: str = "", *,
                 on_pause: Callable[[], Awaitable[None]] | None = None,
                 on_resume: Callable[[int], Awaitable[None]] | None = None,
                 shards: Sequence[Shard] | None = None, framework: str = "embedded",
                 parallel: Mapping[str, int] | None = None, host: str = "127.0.0.1", version: int = 0,
                 tls: Tls | None = None,
                 load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None,
                 pull: Callable[[PullJob], Awaitable[PullResult]] | None = None) -> None:
        if pull is not None and (params or shards is None or load_weights is not None):
            raise FieldError("pull", "a receiver pulling elsewhere takes its shards, no params and no load_weights")
        self.rank_id = rank_id
        self.key = tickets.new_key()       # an Apply is taken only when signed with it by the coordinator
        self._seen_syncs: collections.OrderedDict[str, None] = collections.OrderedDict()  # no request twice
        self.params = {k: v.detach() for k, v in dedupe_tied(params).items()}
        self.shards = list(shards) if shards is not None else hf_full_shards(self.params)
        self.framework = framework
        self.parallel = dict(parallel or {})
        self._load_weights = load_weights
        self._pull = pull
        if load_weights is not None:
            self.parallel[POST_LOAD_TRANSFORMED] = 1
        self.host = host
        self.version = version
        self.agent_address = ""
        self.registered = asyncio.Event()
        self.last_reply = None
        self._on_pause = on_pause
        self._on_resume = on_resume
        self._lock = asyncio.Lock()
        self._registry = _Client(wx_address, token, tls)

    def layout(self) -> RankLayout:
        return RankLayout(self.rank_id, RECEIVER, self.framework, self.shards, self.parallel,
                          agent_address=self.agent_address, host=self.host, version=self.version)

    def servicer(self) -> Servicer:
        """The WeightAgentService to host on the inference process's gRPC server."""
        return Servicer(wx_grpc.add_WeightAgentServiceServicer_to_server, _AgentServicer(self),
                        wx_pb2.DESCRIPTOR.services_by_name["WeightAgentService"].full_name)

    async def register(self, agent_address: str = "") -> wx_pb2.RegisterReply:
        """Register this rank's layout (role RECEIVER) with the version it has applied; `agent_address` is where
        `servicer()` is hosted (default: the address of the previous registration)."""
        self.agent_address = agent_address or self.agent_address
        return await self._send(self.layout())

    async def keep_registered(self, stop: asyncio.Event, interval: float = 5.0, *, agent_address: str = "") -> None:
        """As `SenderAgent.keep_registered`; `agent_address` as in `register`."""
        self.agent_address = agent_address or self.agent_address
        await super().keep_registered(stop, interval)

    async def close(self) -> None:
        await self._registry.close()

    async def apply(self, request: wx_pb2.ApplyRequest, context: grpc.aio.ServicerContext) -> wx_pb2.ApplyReply:
        if not tickets.apply_signed(self.key, request):
            log.warning("apply_refused", rank_id=self.rank_id, version=request.version, reason="not signed")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{self.rank_id}: apply refused: not signed by "
                                "the coordinator this rank registered with")
        if request.sync_id in self._seen_syncs:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{self.rank_id}: apply refused: update "
                                f"{request.sync_id} was already applied (a replay)")
        self._seen_syncs[request.sync_id] = None
        while len(self._seen_syncs) > 4096:
            self._seen_syncs.popitem(last=False)
        if request.version < 0:
            await invalid_argument(context, "version", f"must be >= 0, got {request.version}")
        if request.timeout_seconds <= 0:
            await invalid_argument(context, "timeout_seconds", "must be positive")
        transfers = [Transfer.from_proto(t) for t in request.transfers]
        for i, t in enumerate(transfers):
            if t.dst != self.rank_id:
                await invalid_argument(context, f"transfers[{i}].dst_rank_id", f"{t.dst!r} is not {self.rank_id!r}")
        # shielded: an Apply whose caller went away (a restarted trainer cancels its Sync) still resumes the
        # engine it paused; otherwise generation would stay paused for good
        job = asyncio.ensure_future(self._apply(request, transfers))
        try:
            result = await asyncio.shield(job)
        except _ApplyFailed as exc:
            await context.abort(exc.code, exc.message)
        log.info("applied", rank_id=self.rank_id, version=request.version, bytes=result.bytes_received,
                 delta=request.delta,
                 seconds=round(result.seconds, 4), plan_hash=request.plan_hash)
        return wx_pb2.ApplyReply(bytes_received=result.bytes_received, seconds=result.seconds,
                                 checksum=result.checksum, bytes_full=result.bytes_full)

    async def _apply(self, request: wx_pb2.ApplyRequest, transfers: list[Transfer]):
        """Pause, pull every planned range into the live tensors, resume (at the new version on success)."""
        async with self._lock:
            old = self.version
            try:
                if self._on_pause is not None:
                    await self._on_pause()
            except Exception as exc:
                # no resume: a failed pause leaves no pause behind (the engines undo their own), and a resume
                # here would undo someone else's, an operator's Pause
                log.warning("pause_failed", rank_id=self.rank_id, version=request.version, error=str(exc))
                raise _ApplyFailed(grpc.StatusCode.UNAVAILABLE, f"{self.rank_id}: pause failed: {exc}") from exc
            try:
                if request.delta and request.delta_base_version != old:
                    raise FieldError("delta_base_version", f"{self.rank_id} holds version {old}, not "
                                     f"{request.delta_base_version}: a full update is needed")
                job = PullJob(self.rank_id, transfers, dict(request.sender_endpoints), request.transport,
                              request.timeout_seconds, request.verify, request.version,
                              dict(request.sender_tickets), request.sync_id,
                              delta_base=request.delta_base_version if request.delta else None,
                              track=request.track_delta)
                if self._pull is not None:
                    result = await self._pull(job)
                else:
                    targets = self._targets(transfers)
                    result = await asyncio.to_thread(job.run, targets)
                if self._load_weights is not None:
                    try:
                        await asyncio.to_thread(self._load_weights, sorted(targets.items()))
                    except Exception as exc:  # noqa: BLE001 - the engine's failure fails this update
                        raise FieldError("load_weights", f"{type(exc).__name__}: {exc}") from exc
            except (ValueError, TransportError) as exc:
                await self._resume(old)
                log.warning("apply_failed", rank_id=self.rank_id, version=request.version, error=str(exc))
                code = (grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, ValueError) else
                        grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(exc, TransferTimeout) else
                        grpc.StatusCode.ABORTED)
                raise _ApplyFailed(code, f"{self.rank_id}: {exc}") from exc
            except BaseException:
                await self._resume(old)
                raise
            self.version = request.version
            await self._resume(request.version)
            return result

    def _targets(self, transfers: Sequence[Transfer]) -> Mapping[str, torch.Tensor]:
        """Where the transfers land: the live tensors, or (post-load transformed) fresh staging tensors of the
        checkpoint tensors named by the transfers; a transfer naming anything else fails (no raw live writes)."""
        if self._load_weights is None:
            return self.params
        staging = {s.canonical_name: s for s in self.layout().staging_shards()}
        out = {}
        for name in sorted({t.dst_local for t in transfers}):
            if name not in staging:
                raise FieldError("transfers.dst_local_name", f"{name!r} is not a checkpoint tensor of {self.rank_id} "
                                 f"(post-load-transformed layout: only staging tensors are written)")
            out[name] = torch.empty(staging[name].canonical_shape, dtype=torch_dtype(staging[name].dtype))
        return out

    async def _resume(self, version: int) -> None:
        if self._on_resume is not None:
            await self._on_resume(version)


class _ApplyFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _AgentServicer(wx_grpc.WeightAgentServiceServicer):
    def __init__(self, agent: ReceiverAgent) -> None:
        self.agent = agent

    async def Apply(self, request, context):  # noqa: N802 - gRPC method name
        return await self.agent.apply(request, context)
