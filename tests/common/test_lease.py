"""The single-active lease (services/common/lease.py) against a real nats-server: one holder, a standby that waits,
take-over on release and on a lapsed lease, a fenced-off old holder, and a holder that stops itself when it can
no longer renew."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import pytest

from services.common.bus import Bus
from services.common.lease import LEASE_LOST_EXIT, LeaseLost, acquire, check_ttl, holder_id
from tests.lines import read_line

TTL = 3.0


async def connect(server, name: str) -> Bus:
    return await Bus.connect(server.url, name=name, max_bytes=-1)


async def test_a_second_instance_waits_as_standby_and_takes_over_when_the_first_releases(nats_server):
    a, b = await connect(nats_server, "a"), await connect(nats_server, "b")
    stop = asyncio.Event()
    try:
        first = await asyncio.wait_for(acquire(a, "builder", ttl=TTL, stop=stop, holder="a"), 10)
        standby = asyncio.create_task(acquire(b, "builder", ttl=TTL, stop=stop, holder="b", poll=0.1))
        keeper = asyncio.create_task(first.keep(stop))
        await asyncio.sleep(2 * TTL)  # renewed all along: the standby never gets it
        assert not standby.done()
        await first.release()
        keeper.cancel()
        t0 = time.monotonic()
        second = await asyncio.wait_for(standby, 5)
        assert second.holder == "b" and time.monotonic() - t0 < 2
        assert second.token > first.token
    finally:
        stop.set()
        await a.close()
        await b.close()


async def test_a_lapsed_lease_passes_to_the_standby_and_the_old_holder_is_fenced_off(nats_server):
    a, b = await connect(nats_server, "a"), await connect(nats_server, "b")
    stop = asyncio.Event()
    try:
        first = await asyncio.wait_for(acquire(a, "weight_exchange", ttl=TTL, stop=stop, holder="a"), 10)
        # `a` stops renewing (a paused or partitioned process): after the TTL the standby holds it
        t0 = time.monotonic()
        second = await asyncio.wait_for(acquire(b, "weight_exchange", ttl=TTL, stop=stop, holder="b", poll=0.1), 15)
        assert TTL - 0.5 <= time.monotonic() - t0 <= TTL + 5
        with pytest.raises(LeaseLost, match="another instance holds the lease"):
            await first._renew(deadline=time.monotonic() + 5)
        assert second.holder == "b"
    finally:
        stop.set()
        await a.close()
        await b.close()


async def test_leases_of_different_services_are_independent(nats_server):
    a = await connect(nats_server, "a")
    stop = asyncio.Event()
    try:
        builder = await asyncio.wait_for(acquire(a, "builder", ttl=TTL, stop=stop), 10)
        wx = await asyncio.wait_for(acquire(a, "weight_exchange", ttl=TTL, stop=stop), 10)
        assert builder.service == "builder" and wx.service == "weight_exchange"
    finally:
        stop.set()
        await a.close()


async def test_a_holder_that_cannot_renew_stops_itself_before_the_lease_can_expire(nats_server):
    a = await connect(nats_server, "a")
    stop = asyncio.Event()
    try:
        lease = await asyncio.wait_for(acquire(a, "builder", ttl=TTL, stop=stop), 10)
        nats_server.stop()  # NATS away: renewals fail
        t0 = time.monotonic()
        with pytest.raises(LeaseLost, match="could not renew"):
            await asyncio.wait_for(lease.keep(stop), 3 * TTL)
        assert time.monotonic() - t0 < TTL  # before the key could lapse and a standby take over
    finally:
        stop.set()
        await a.close()


async def test_a_standby_gives_up_waiting_when_stopped_and_short_ttls_are_refused(nats_server):
    with pytest.raises(ValueError, match="lease_seconds"):
        check_ttl(1.0)
    a, b = await connect(nats_server, "a"), await connect(nats_server, "b")
    stop, standby_stop = asyncio.Event(), asyncio.Event()
    try:
        await asyncio.wait_for(acquire(a, "builder", ttl=TTL, stop=stop), 10)
        standby = asyncio.create_task(acquire(b, "builder", ttl=60.0, stop=standby_stop, poll=0.1))
        await asyncio.sleep(0.5)
        standby_stop.set()
        assert await asyncio.wait_for(standby, 5) is None
    finally:
        stop.set()
        await a.close()
        await b.close()


async def test_a_lease_left_by_a_dead_process_of_this_host_is_taken_over_at_once(nats_server):
    """A SIGKILLed builder restarted by its supervisor does not wait out its own previous life's TTL."""
    dead = subprocess.Popen(["true"])
    dead.wait(10)
    a, b = await connect(nats_server, "a"), await connect(nats_server, "b")
    stop = asyncio.Event()
    try:
        await asyncio.wait_for(acquire(a, "builder", ttl=30.0, stop=stop, holder=f"{socket.gethostname()}:{dead.pid}"),
                               10)
        t0 = time.monotonic()
        taken = await asyncio.wait_for(acquire(b, "builder", ttl=30.0, stop=stop, poll=0.1), 10)
        assert time.monotonic() - t0 < 5 and taken.holder == holder_id()
        # a live holder of this host is waited for
        alive = asyncio.create_task(acquire(a, "builder", ttl=30.0, stop=stop, poll=0.1))
        await asyncio.sleep(1.0)
        assert not alive.done()
        alive.cancel()
    finally:
        stop.set()
        await a.close()
        await b.close()


HOLDER = """
import asyncio, sys
from services.common.bus import Bus
from services.common.lease import acquire
async def main():
    bus = await Bus.connect(sys.argv[1], name="holder", max_bytes=-1)
    stop = asyncio.Event()
    lease = await acquire(bus, "builder", ttl=3.0, stop=stop)
    print("held", flush=True)
    await lease.hold(stop)
asyncio.run(main())
"""


def test_a_service_that_loses_its_lease_exits_at_once(nats_server):
    """Fencing: no graceful stop (its writes under way could land after a standby took over)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, nats_server.url], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        while read_line(proc, 60, "held").strip() != "held":  # log lines come first
            pass
        nats_server.stop()
        t0 = time.monotonic()
        assert proc.wait(30) == LEASE_LOST_EXIT
        assert time.monotonic() - t0 < 10
    finally:
        proc.kill()
        proc.wait(10)
