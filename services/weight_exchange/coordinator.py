"""Registrations, the cached plan, and one Sync: every receiver's Apply in parallel, then the deployed event.

No gRPC here: the server injects `apply` (call one receiver) and `on_deployed` (publish the event).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable

from services.common.contracts import weight_exchange_pb2 as wx_pb2
from services.common.logging import get_logger
from services.weight_exchange.client import transports
from services.weight_exchange.client.layout import RECEIVER, SENDER, RankLayout
from services.weight_exchange.planner import Plan, PlanError, bytes_min, plan

log = get_logger()


class SyncError(Exception):
    """A Sync that did not deploy; `code` is a grpc.StatusCode name, the message names ranks and tensors."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ApplyError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


ApplyFn = Callable[[RankLayout, wx_pb2.ApplyRequest, float], Awaitable[wx_pb2.ApplyReply]]


@dataclasses.dataclass
class SyncResult:
    version: int
    seconds: float
    bytes_moved: int
    num_receivers: int
    plan_hash: str


class Coordinator:
    def __init__(self, *, apply: ApplyFn, on_deployed: Callable[[int], Awaitable[None]] | None = None,
                 bucket_bytes: int = 64 << 20, default_transport: str = "tcp", transfer_timeout: float = 120.0,
                 control_timeout: float = 60.0, verify: bool = False) -> None:
        self.apply = apply
        self.on_deployed = on_deployed
        self.bucket_bytes = bucket_bytes
        self.default_transport = default_transport
        self.transfer_timeout = transfer_timeout
        self.control_timeout = control_timeout
        self.verify = verify
        self.ranks: dict[str, RankLayout] = {}
        self.deployed_version = -1
        self.syncs = 0
        self.last_sync_seconds = 0.0
        self.last_bytes_moved = 0
        self._plan: Plan | None = None
        self._by_receiver: dict[str, list[wx_pb2.Transfer]] = {}
        self._lock = asyncio.Lock()
        self._inflight: dict[int, asyncio.Future[SyncResult]] = {}

    @property
    def senders(self) -> list[RankLayout]:
        return [r for r in self.ranks.values() if r.role == SENDER]

    @property
    def receivers(self) -> list[RankLayout]:
        return [r for r in self.ranks.values() if r.role == RECEIVER]

    def register(self, layout: RankLayout) -> None:
        """Add or replace (same rank_id: a restarted process) a rank; ValueError names the bad field."""
        layout.validate()
        for name in layout.endpoints:
            if name not in transports.KNOWN:
                raise ValueError(f"layout.endpoints: unknown transport {name!r} (known: {', '.join(transports.KNOWN)})")
        replaced = layout.rank_id in self.ranks
        self.ranks[layout.rank_id] = layout
        self._plan = None
        log.info("registered", rank_id=layout.rank_id, role=layout.role, framework=layout.framework,
                 shards=len(layout.shards), bytes=layout.num_bytes, replaced=replaced)

    def current_plan(self) -> Plan:
        """The plan for the current registrations (cached until they change); PlanError when they do not match."""
        if self._plan is None:
            self._plan = plan(self.senders, self.receivers, bucket_bytes=self.bucket_bytes)
            self._by_receiver = {r: [] for r in self._plan.receivers}
            for t in self._plan.transfers:
                self._by_receiver[t.dst].append(t.to_proto())
            log.info("planned", plan_hash=self._plan.plan_hash, bytes=self._plan.stats.total_bytes,
                     messages=self._plan.stats.num_messages, links=self._plan.stats.num_links)
        return self._plan

    def plan_reply(self, include_transfers: bool) -> wx_pb2.PlanReply:
        p = self.current_plan()
        s = p.stats
        stats = wx_pb2.PlanStats(total_bytes=s.total_bytes, max_bytes_per_link=s.max_bytes_per_link,
                                 max_bytes_per_rank=s.max_bytes_per_rank, num_messages=s.num_messages,
                                 num_buckets=s.num_buckets, num_links=s.num_links,
                                 bytes_min=bytes_min(self.receivers, _wire_itemsizes(self.senders)))
        transfers = [t.to_proto() for t in p.transfers] if include_transfers else []
        return wx_pb2.PlanReply(transfers=transfers, stats=stats, plan_hash=p.plan_hash)

    def check_transport(self, transport: str) -> str:
        """The transport to use; ValueError naming `transport` when unknown or not offered by a sender."""
        name = transport or self.default_transport
        if name not in transports.KNOWN:
            raise ValueError(f"transport: unknown {name!r} (known: {', '.join(transports.KNOWN)})")
        for s in self.senders:
            if name not in s.endpoints:
                raise ValueError(f"transport: sender {s.rank_id} offers no {name!r} endpoint "
                                 f"(offers {', '.join(sorted(s.endpoints))})")
        return name

    async def sync(self, version: int, transport: str = "", verify: bool | None = None) -> SyncResult:
        """Deploy `version` to every receiver. Concurrent calls for the same version share one update."""
        if version < 0:
            raise ValueError(f"version: must be >= 0, got {version}")
        running = self._inflight.get(version)
        if running is not None:
            return await asyncio.shield(running)
        future: asyncio.Future[SyncResult] = asyncio.get_running_loop().create_future()
        self._inflight[version] = future
        try:
            async with self._lock:
                result = await self._sync(version, transport, self.verify if verify is None else verify)
            future.set_result(result)
            return result
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved
            raise
        finally:
            self._inflight.pop(version, None)

    async def _sync(self, version: int, transport: str, verify: bool) -> SyncResult:
        start = time.monotonic()
        name = self.check_transport(transport)
        receivers = sorted(self.receivers, key=lambda r: r.rank_id)
        if not receivers:
            return SyncResult(version, 0.0, 0, 0, "")
        if not self.senders:
            raise SyncError("FAILED_PRECONDITION", "no sender is registered")
        try:
            p = self.current_plan()
        except PlanError as exc:
            raise SyncError("FAILED_PRECONDITION", f"plan: {exc}") from exc
        if name in ("shm", "shm-ring"):
            self._check_same_host(p)
        endpoints = {s.rank_id: s.endpoints[name] for s in self.senders}
        calls = []
        for r in receivers:
            mine = self._by_receiver.get(r.rank_id, [])
            srcs = {t.src_rank_id for t in mine}
            request = wx_pb2.ApplyRequest(version=version, transport=name, transfers=mine,
                                          sender_endpoints={s: endpoints[s] for s in srcs},
                                          timeout_seconds=self.transfer_timeout, verify=verify,
                                          plan_hash=p.plan_hash)
            calls.append(self.apply(r, request, self.transfer_timeout + self.control_timeout))
        results = await asyncio.gather(*calls, return_exceptions=True)
        failures = [(r.rank_id, res) for r, res in zip(receivers, results, strict=True) if isinstance(res, BaseException)]
        if failures:
            codes = {getattr(exc, "code", "ABORTED") for _, exc in failures}
            code = "DEADLINE_EXCEEDED" if codes == {"DEADLINE_EXCEEDED"} else "ABORTED"
            detail = "; ".join(f"{rank}: {exc}" for rank, exc in failures)
            log.warning("sync_failed", version=version, failed=[rank for rank, _ in failures], error=detail)
            raise SyncError(code, f"sync of version {version} failed on {len(failures)} of {len(receivers)} "
                                  f"receivers: {detail}")
        seconds = time.monotonic() - start
        moved = sum(res.bytes_received for res in results)  # type: ignore[union-attr]
        self.deployed_version = version
        self.syncs += 1
        self.last_sync_seconds = seconds
        self.last_bytes_moved = moved
        log.info("synced", version=version, seconds=round(seconds, 4), bytes=moved, receivers=len(receivers),
                 plan_hash=p.plan_hash, transport=name)
        if self.on_deployed is not None:
            await self.on_deployed(version)
        return SyncResult(version, seconds, moved, len(receivers), p.plan_hash)

    def _check_same_host(self, p: Plan) -> None:
        hosts = {r.rank_id: r.host for r in self.ranks.values()}
        for t in p.transfers:
            if hosts.get(t.src) != hosts.get(t.dst):
                raise SyncError("FAILED_PRECONDITION", f"transport: shm needs sender {t.src} (host "
                                f"{hosts.get(t.src)!r}) and receiver {t.dst} (host {hosts.get(t.dst)!r}) on one host")


def _wire_itemsizes(senders: list[RankLayout]) -> dict[str, int]:
    return {s.canonical_name: s.itemsize for layout in senders for s in layout.shards}
