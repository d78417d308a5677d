"""One active instance of a single-active service (builder, weight_exchange), fenced by a JetStream KV lease.

Two builders (a partitioned node whose pod was replaced, `kubectl scale`, `compose --scale`, a rolling update's
surge) would split the durable consumer's messages between them and publish different batches under one index;
two weight exchanges would split the ranks' registrations. So an instance runs only while it holds the lease:

- the lease is key `holder` in the bucket `meshrl_lease_<service>` (one bucket per service, so one identity's
  NATS permissions reach only its own), created with `create` (refused while another instance holds it);
- the holder renews it every `ttl / 3` with `update(last=revision)`: the revision is the fencing token, and an
  update refused because the revision moved means someone else holds it now;
- the bucket's TTL removes a lease its holder stopped renewing (killed, partitioned), so a standby, polling,
  takes over `ttl` seconds after the holder's last renewal;
- the holder stops itself (`LeaseLost`) once it has not renewed for `ttl - margin` seconds, before the key can
  expire, so two instances never both believe they hold it; a clean stop deletes the lease for an immediate
  take-over;
- a lease left by a process of this same host that no longer runs (a SIGKILLed builder its supervisor restarts,
  or a restarted container whose pid it now has) is taken over at once instead of after the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import sys
import time

import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from services.common.bus import TRANSIENT, Bus, retry
from services.common.config import check_lease_seconds
from services.common.logging import get_logger
from services.common.runtime import sleep_or_stop

KEY = "holder"
LEASE_LOST_EXIT = 75  # EX_TEMPFAIL: restart me
BUCKET_BYTES = 1 << 20  # a lease bucket's byte cap (one small key), outside nats_max_bytes
_HELD_HERE: set[str] = set()  # services whose lease this process holds


class LeaseLost(RuntimeError):
    """This instance no longer holds its service's lease: it must stop now (another one may be active)."""


def bucket_name(service: str) -> str:
    return f"meshrl_lease_{service}"


def holder_id() -> str:
    """Who holds a lease, for logs and the standby's message: host and pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


check_ttl = check_lease_seconds


@dataclasses.dataclass
class Lease:
    kv: KeyValue
    service: str
    holder: str
    ttl: float
    revision: int
    renewed: float  # monotonic time of the last confirmed create / update

    @property
    def token(self) -> int:
        """The fencing token: grows with every renewal, and no two holders ever share one."""
        return self.revision

    async def keep(self, stop: asyncio.Event) -> None:
        """Renew every ttl/3 until `stop`; LeaseLost when another instance took it or renewals failed for too long."""
        every, margin = self.ttl / 3, min(1.0, self.ttl / 6)
        while not stop.is_set():
            if await sleep_or_stop(stop, every):
                return
            await self._renew(deadline=self.renewed + self.ttl - margin)

    async def _renew(self, deadline: float) -> None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                _HELD_HERE.discard(self.service)
                raise LeaseLost(f"{self.service}: could not renew the lease within {self.ttl:.0f}s; stopping "
                                "before a standby may take it over")
            try:
                self.revision = await asyncio.wait_for(self.kv.update(KEY, self._value(), last=self.revision), left)
                self.renewed = time.monotonic()
                return
            except nats.js.errors.KeyWrongLastSequenceError as exc:
                _HELD_HERE.discard(self.service)
                raise LeaseLost(f"{self.service}: another instance holds the lease now (revision moved past "
                                f"{self.revision})") from exc
            except TRANSIENT as exc:  # NATS away for a moment (TimeoutError included): until the deadline
                get_logger().warning("lease_renew_retry", service=self.service, error=repr(exc))
                await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    async def hold(self, stop: asyncio.Event) -> None:
        """`keep` for a service: a lost lease ends the process at once (exit 75), since a graceful stop would let
        writes already under way (retried for minutes through an outage) land after a standby took over. Its
        supervisor restarts it, as a standby."""
        try:
            await self.keep(stop)
        except LeaseLost as exc:
            get_logger().error("lease_lost", service=self.service, error=str(exc), reason="exiting at once (fencing)")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(LEASE_LOST_EXIT)

    async def release(self) -> None:
        """Delete the lease (only if it is still ours), so a standby takes over at once; best effort."""
        _HELD_HERE.discard(self.service)
        try:
            await asyncio.wait_for(self.kv.delete(KEY, last=self.revision), 5)
        except (nats.js.errors.KeyWrongLastSequenceError, TimeoutError, *TRANSIENT) as exc:
            get_logger().warning("lease_release_failed", service=self.service, error=repr(exc))

    def _value(self) -> bytes:
        return json.dumps({"holder": self.holder, "ttl": self.ttl}).encode()


async def acquire(bus: Bus, service: str, *, ttl: float, stop: asyncio.Event, holder: str = "",
                  poll: float | None = None) -> Lease | None:
    """Take the service's lease, waiting as a standby while another instance holds it; None once `stop` is set."""
    check_ttl(ttl)
    holder = holder or holder_id()
    kv = await _bucket(bus, service, ttl)
    status = await retry(kv.status, what=f"{service} lease bucket")
    if status.ttl and abs(status.ttl - ttl) > 1e-3:  # the bucket's TTL is what expires leases: renew by it
        get_logger().warning("lease_ttl_from_bucket", service=service, asked=ttl, bucket=status.ttl)
        ttl = status.ttl
    value = json.dumps({"holder": holder, "ttl": ttl}).encode()
    poll = poll if poll is not None else min(1.0, ttl / 3)
    log, announced = get_logger().bind(service=service, holder=holder), ""
    while not stop.is_set():
        try:
            revision = await retry(lambda: kv.create(KEY, value), what=f"{service} lease")
        except nats.js.errors.KeyWrongLastSequenceError:
            current, revision = await _current_holder(kv)
            if revision and abandoned_here(current, service):
                log.info("lease_abandoned", previous=current, reason="its process on this host no longer runs")
                with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError, *TRANSIENT):
                    await kv.delete(KEY, last=revision)
                continue
            if current != announced:
                log.info("lease_standby", active=current,
                         reason=f"another {service} is active; taking over when its lease lapses ({ttl:.0f}s)")
                announced = current
            await sleep_or_stop(stop, poll)
            continue
        log.info("lease_acquired", revision=revision, ttl=ttl)
        _HELD_HERE.add(service)
        return Lease(kv=kv, service=service, holder=holder, ttl=ttl, revision=revision, renewed=time.monotonic())
    return None


async def _current_holder(kv) -> tuple[str, int]:
    """The holder's id and the lease's revision ("", 0 when there is none or it cannot be read now)."""
    try:
        entry = await kv.get(KEY)
    except (nats.js.errors.KeyNotFoundError, nats.js.errors.NotFoundError, *TRANSIENT):
        return "", 0
    try:
        return str(json.loads(entry.value)["holder"]), int(entry.revision or 0)
    except (ValueError, KeyError, TypeError):
        return "?", 0


def abandoned_here(holder: str, service: str) -> bool:
    """`holder` ("host:pid") names this host and a pid that is this process while it does not hold the lease (a
    restarted container: a previous life of it did) or that runs no process."""
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return service not in _HELD_HERE
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # some other user's process runs under that pid
        return False
    return False


async def _bucket(bus: Bus, service: str, ttl: float):
    name = bucket_name(service)

    async def open_kv():
        try:
            return await bus.js.key_value(name)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            return await bus.js.create_key_value(KeyValueConfig(bucket=name, history=1, ttl=ttl,
                                                                replicas=bus.replicas, max_bytes=BUCKET_BYTES))

    return await retry(open_kv, what=f"key-value bucket {name}")
