"""Registrations, the cached plan, and one Sync: every receiver's Apply in parallel, then the deployed event.

Registrations are heartbeats, so the service can restart at any moment: a re-registration with the same layout
(but for its version) refreshes the rank, a changed layout replaces it, and a rank silent for `rank_ttl` seconds
is dropped, so no Sync waits on a dead peer. Every layout carries a version (a sender's parameters, a receiver's
applied weights); a receiver that registers behind the senders is caught up in the background.
No gRPC here: the server injects `apply` (call one receiver) and `on_deployed` (publish the event).

Each registration may bring the rank's key and its owner (the caller's identity): a live rank is never replaced by
another owner, and every update carries a fresh sync_id with a pull ticket per sender and a signature per receiver
made with those keys (client/tickets.py), so receivers and senders act only on this coordinator's word.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.common.contracts import weight_exchange_pb2 as wx_pb2
from services.common.errors import FieldError
from services.common.logging import get_logger
from services.common.runtime import cancel_and_wait
from services.weight_exchange.client import tickets, transports
from services.weight_exchange.client.layout import RECEIVER, SENDER, RankLayout
from services.weight_exchange.planner import Plan, PlanError, bytes_min, plan

log = get_logger()
GRACE = 5.0               # on top of an Apply's own deadline, in case the injected call has none
MAX_CATCH_UP_DELAY = 30.0


class SyncError(Exception):
    """A Sync that did not deploy; `code` is a grpc.StatusCode name, the message names ranks and tensors."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class RegisterDenied(Exception):
    """A registration that would replace a live rank registered by another identity."""


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
    delta: bool = False     # every receiver took a delta
    bytes_full: int = 0     # the receivers' bytes in their dtypes (what a full update moves at least)


class Coordinator:
    def __init__(self, *, apply: ApplyFn, on_deployed: Callable[[int], Awaitable[None]] | None = None,
                 bucket_bytes: int = 64 << 20, default_transport: str = "tcp", transfer_timeout: float = 120.0,
                 control_timeout: float = 60.0, verify: bool = False, rank_ttl: float = 30.0,
                 catch_up_delay: float = 0.5, clock: Callable[[], float] = time.monotonic, delta: bool = False,
                 full_every: int = 10) -> None:
        if full_every < 1:
            raise FieldError("full_every", f"must be >= 1, got {full_every}")
        self.apply = apply
        self.on_deployed = on_deployed
        self.bucket_bytes = bucket_bytes
        self.default_transport = default_transport
        self.transfer_timeout = transfer_timeout
        self.control_timeout = control_timeout
        self.verify = verify
        self.rank_ttl = rank_ttl              # <= 0: ranks never expire
        self.catch_up_delay = catch_up_delay  # before a catch-up's first try; doubles after each failed one
        self.clock = clock
        self.delta = delta                    # steady-state updates send only what changed (delta.py)
        self.full_every = full_every          # with delta: a full update at least every this many updates
        # receiver -> deltas it took since its last full update; absent: its next update is full (new, restarted,
        # failed, or a sender restarted and lost what it served)
        self._since_full: dict[str, int] = {}
        self.ranks: dict[str, RankLayout] = {}
        self.deployed_version = -1
        self.syncs = 0
        self.catch_ups = 0
        self.last_sync_seconds = 0.0
        self.last_bytes_moved = 0
        self._seen: dict[str, float] = {}     # rank_id -> clock() of its last registration
        self._keys: dict[str, bytes] = {}     # rank_id -> its key (tickets, signatures); none: sent unsigned
        self._owners: dict[str, str] = {}     # rank_id -> the identity that registered it ("" without auth)
        self._transport = ""                  # of the last successful Sync: what catch-ups use
        self._plan: Plan | None = None
        self._by_receiver: dict[str, list[wx_pb2.Transfer]] = {}
        self._lock = asyncio.Lock()           # one update at a time: a Sync or a catch-up
        self._inflight: dict[int, asyncio.Future[SyncResult]] = {}
        self._catch_ups: dict[str, asyncio.Task[None]] = {}

    @property
    def senders(self) -> list[RankLayout]:
        return [r for r in self.ranks.values() if r.role == SENDER]

    @property
    def receivers(self) -> list[RankLayout]:
        return [r for r in self.ranks.values() if r.role == RECEIVER]

    @property
    def sender_version(self) -> int:
        """The highest version a registered sender reports; -1 when none is registered."""
        return max((s.version for s in self.senders), default=-1)

    def register(self, layout: RankLayout, *, key: str = "", owner: str | None = None) -> None:
        """Add, refresh (a heartbeat: same layout but for the version) or replace (a restarted process) a rank;
        ValueError names the bad field. `key` (hex) is the rank's secret for tickets and signatures, `owner` the
        caller's identity: RegisterDenied when the rank is live and registered by another owner. A receiver behind
        the senders is caught up in the background."""
        layout.validate()
        for name in layout.endpoints:
            if name not in transports.KNOWN:
                raise FieldError("layout.endpoints", f"unknown transport {name!r} (known: {', '.join(transports.KNOWN)})")
        secret = tickets.parse_key(key) if key else None
        self.expire()
        old = self.ranks.get(layout.rank_id)
        owner = owner or ""
        if old is not None and self._owners.get(layout.rank_id, "") != owner:
            log.warning("register_denied", rank_id=layout.rank_id, owner=self._owners.get(layout.rank_id, ""),
                        caller=owner)
            raise RegisterDenied(f"rank_id: {layout.rank_id} is registered by {self._owners.get(layout.rank_id)!r}; "
                                 f"{owner!r} may not replace it while it is live")
        self.ranks[layout.rank_id] = layout
        self._seen[layout.rank_id] = self.clock()
        self._owners[layout.rank_id] = owner
        if secret is None:
            self._keys.pop(layout.rank_id, None)
        else:
            self._keys[layout.rank_id] = secret
        if old is None or not old.same_except_version(layout):
            self._plan = None
            if layout.role == SENDER:
                self._since_full.clear()
            self._since_full.pop(layout.rank_id, None)
            log.info("registered", rank_id=layout.rank_id, role=layout.role, framework=layout.framework,
                     shards=len(layout.shards), bytes=layout.num_bytes, version=layout.version,
                     replaced=old is not None)
        if layout.role == RECEIVER and layout.version < self.sender_version:
            self._start_catch_up(layout.rank_id)

    def expire(self) -> list[str]:
        """Drop the ranks silent for more than `rank_ttl` seconds; returns their ids."""
        if self.rank_ttl <= 0:
            return []
        now = self.clock()
        dead = sorted(r for r, seen in self._seen.items() if now - seen > self.rank_ttl)
        for rank_id in dead:
            layout = self.ranks.pop(rank_id)
            self._keys.pop(rank_id, None)
            self._owners.pop(rank_id, None)
            log.warning("rank_expired", rank_id=rank_id, role=layout.role,
                        silent_seconds=round(now - self._seen.pop(rank_id), 1))
        if dead:
            self._plan = None
        return dead

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
            raise FieldError("transport", f"unknown {name!r} (known: {', '.join(transports.KNOWN)})")
        for s in self.senders:
            if name not in s.endpoints:
                raise FieldError("transport", f"sender {s.rank_id} offers no {name!r} endpoint "
                                 f"(offers {', '.join(sorted(s.endpoints))})")
        return name

    async def sync(self, version: int, transport: str = "", verify: bool | None = None) -> SyncResult:
        """Deploy `version` to every receiver. Concurrent calls for the same version share one update."""
        if version < 0:
            raise FieldError("version", f"must be >= 0, got {version}")
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
        self.expire()
        name = self.check_transport(transport)
        receivers = sorted(self.receivers, key=lambda r: r.rank_id)
        if not receivers:
            raise SyncError("FAILED_PRECONDITION", f"no receiver is registered: nothing to deploy version {version} to")
        if not self.senders:
            raise SyncError("FAILED_PRECONDITION", "no sender is registered")
        # a version below a receiver's is deployed too: a trainer resumed from an older checkpoint is the
        # lineage now (the senders refuse to serve any version other than the one they hold)
        p, results, delta = await self._update(receivers, version, name, verify)
        seconds = time.monotonic() - start
        moved = sum(res.bytes_received for res in results)
        self.deployed_version = version
        self.syncs += 1
        self.last_sync_seconds = seconds
        self.last_bytes_moved = moved
        self._transport = name
        log.info("synced", version=version, seconds=round(seconds, 4), bytes=moved, receivers=len(receivers),
                 plan_hash=p.plan_hash, transport=name, delta=delta)
        if self.on_deployed is not None:
            await self.on_deployed(version)
        return SyncResult(version, seconds, moved, len(receivers), p.plan_hash, delta,
                          sum(res.bytes_full for res in results))

    async def _update(self, receivers: list[RankLayout], version: int, name: str, verify: bool,
                      allow_delta: bool = True) -> tuple[Plan, list[wx_pb2.ApplyReply], bool]:
        """Every receiver's Apply in parallel; SyncError naming each failed receiver (and, from it, the sender).
        A receiver whose delta failed gets a full update at once, within the same call. The bool: every receiver
        took a delta."""
        try:
            p = self.current_plan()
        except PlanError as exc:
            raise SyncError("FAILED_PRECONDITION", f"plan: {exc}") from exc
        if name in ("shm", "shm-ring"):
            self._check_same_host(p)
        timeout = self.transfer_timeout + self.control_timeout
        deltas = {r.rank_id: allow_delta and self._delta_due(r, version) for r in receivers}
        results = await self._apply_all(p, receivers, version, name, verify, deltas, timeout)
        retry = [r for r, res in zip(receivers, results, strict=True)
                 if isinstance(res, BaseException) and deltas[r.rank_id]]
        if retry:
            log.warning("delta_failed", version=version, receivers=[r.rank_id for r in retry],
                        error="; ".join(str(res) for res in results if isinstance(res, BaseException))[:500])
            for r in retry:
                deltas[r.rank_id] = False
            again = await self._apply_all(p, retry, version, name, verify, deltas, timeout)
            by_rank = {r.rank_id: res for r, res in zip(retry, again, strict=True)}
            results = [by_rank.get(r.rank_id, res) for r, res in zip(receivers, results, strict=True)]
        failures = []
        for r, res in zip(receivers, results, strict=True):
            if isinstance(res, BaseException):
                failures.append((r.rank_id, res))
                self._since_full.pop(r.rank_id, None)   # whatever landed, the next update is full
            else:
                self._applied(r, version)
                self._since_full[r.rank_id] = self._since_full.get(r.rank_id, 0) + 1 if deltas[r.rank_id] else 0
        if failures:
            codes = {_code(exc) for _, exc in failures}
            code = "DEADLINE_EXCEEDED" if codes == {"DEADLINE_EXCEEDED"} else "ABORTED"
            silent = f"no answer within {timeout + GRACE:.0f}s"
            detail = "; ".join(f"{rank}: {str(exc) or silent}" for rank, exc in failures)
            log.warning("sync_failed", version=version, failed=[rank for rank, _ in failures], error=detail)
            raise SyncError(code, f"sync of version {version} failed on {len(failures)} of {len(receivers)} "
                                  f"receivers: {detail}")
        for s in self.senders:
            if s.version >= 0:      # tracked: it just served `version`
                s.version = max(s.version, version)
        return p, results, all(deltas.values())  # type: ignore[return-value]

    def _delta_due(self, receiver: RankLayout, version: int) -> bool:
        """A delta from the version the receiver holds: deltas on, it took a full update since it (re)registered,
        fewer than `full_every - 1` deltas since, and it holds an older version."""
        since = self._since_full.get(receiver.rank_id)
        return (self.delta and since is not None and since < self.full_every - 1
                and 0 <= receiver.version != version)

    async def _apply_all(self, p: Plan, receivers: list[RankLayout], version: int, name: str, verify: bool,
                         deltas: dict[str, bool], timeout: float) -> list[Any]:
        endpoints = {s.rank_id: s.endpoints[name] for s in self.senders}
        sync_id = tickets.new_sync_id()
        calls = []
        for r in receivers:
            mine = self._by_receiver.get(r.rank_id, [])
            srcs = {t.src_rank_id for t in mine}
            request = wx_pb2.ApplyRequest(version=version, transport=name, transfers=mine,
                                          sender_endpoints={s: endpoints[s] for s in srcs},
                                          timeout_seconds=self.transfer_timeout, verify=verify,
                                          plan_hash=p.plan_hash, sync_id=sync_id,
                                          sender_tickets={s: tickets.ticket(self._keys[s], r.rank_id, version, sync_id)
                                                          for s in srcs if s in self._keys},
                                          delta=deltas[r.rank_id], delta_base_version=r.version if deltas[r.rank_id]
                                          else 0, track_delta=self.delta)
            if r.rank_id in self._keys:
                tickets.sign_apply(self._keys[r.rank_id], request)
            calls.append(asyncio.wait_for(self.apply(r, request, timeout), timeout + GRACE))
        return await asyncio.gather(*calls, return_exceptions=True)

    def _applied(self, receiver: RankLayout, version: int) -> None:
        current = self.ranks.get(receiver.rank_id)
        if current is not None and current.agent_address == receiver.agent_address:
            current.version = version

    def _start_catch_up(self, rank_id: str) -> None:
        if rank_id in self._catch_ups:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return      # no event loop (a synchronous caller): the next heartbeat tries again
        self._catch_ups[rank_id] = loop.create_task(self._catch_up(rank_id), name=f"catch-up-{rank_id}")

    async def _catch_up(self, rank_id: str) -> None:
        """Bring one receiver to the senders' version, retrying with back-off while it lags and is registered."""
        delay = self.catch_up_delay
        try:
            while True:
                await asyncio.sleep(delay)
                async with self._lock:
                    if await self._catch_up_once(rank_id):
                        return
                delay = min(max(delay, 0.1) * 2, MAX_CATCH_UP_DELAY)
        finally:
            self._catch_ups.pop(rank_id, None)

    async def _catch_up_once(self, rank_id: str) -> bool:
        """One try (under the lock); True when there is nothing (left) to do."""
        self.expire()
        receiver, target = self.ranks.get(rank_id), self.sender_version
        if receiver is None or receiver.role != RECEIVER or receiver.version >= target:
            return True
        if any(s.version != target for s in self.senders):
            log.info("catch_up_waiting", rank_id=rank_id, version=target,
                     senders={s.rank_id: s.version for s in self.senders})
            return False
        try:
            name = self._catch_up_transport()
            await self._update([receiver], target, name, self.verify, allow_delta=False)
        except (SyncError, ValueError) as exc:
            log.warning("catch_up_failed", rank_id=rank_id, version=target, error=str(exc))
            return False
        self.catch_ups += 1
        log.info("caught_up", rank_id=rank_id, version=target, transport=name)
        if all(r.version >= target for r in self.receivers):
            self.deployed_version = max(self.deployed_version, target)
            if self.on_deployed is not None:
                try:
                    await self.on_deployed(target)
                except Exception as exc:  # noqa: BLE001 - the weights are in place; the event is best effort here
                    log.warning("deployed_event_failed", version=target, error=str(exc))
        return True

    def _catch_up_transport(self) -> str:
        """The last Sync's transport, else the default, else any transport every sender offers."""
        for name in (self._transport, self.default_transport, *transports.KNOWN):
            if name and all(name in s.endpoints for s in self.senders):
                return name
        raise FieldError("transport", "no transport is offered by every sender")

    async def close(self) -> None:
        """Cancel the catch-ups in flight."""
        await cancel_and_wait(list(self._catch_ups.values()))

    def _check_same_host(self, p: Plan) -> None:
        hosts = {r.rank_id: r.host for r in self.ranks.values()}
        for t in p.transfers:
            if hosts.get(t.src) != hosts.get(t.dst):
                raise SyncError("FAILED_PRECONDITION", f"transport: shm needs sender {t.src} (host "
                                f"{hosts.get(t.src)!r}) and receiver {t.dst} (host {hosts.get(t.dst)!r}) on one host")


def _code(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if isinstance(code, str):
        return code
    return "DEADLINE_EXCEEDED" if isinstance(exc, TimeoutError) else "ABORTED"


def _wire_itemsizes(senders: list[RankLayout]) -> dict[str, int]:
    return {s.canonical_name: s.itemsize for layout in senders for s in layout.shards}
