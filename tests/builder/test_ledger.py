"""The builder's ledger on a real JetStream key-value bucket: drops that come together share one record (a group
commit), the issued count carries its refills and last chunk, and records older builders wrote are still read."""

from __future__ import annotations

import asyncio
import json

from services.builder.ledger import BUCKET, Dropped, Ledger
from services.common.bus import Bus


async def opened(nats_server) -> tuple[Bus, Ledger]:
    bus = await Bus.connect(nats_server.url, name="builder")
    ledger = Ledger(bus)
    await ledger.open()
    return bus, ledger


async def keys(ledger: Ledger) -> list[str]:
    return sorted(await ledger._keys())


async def test_drops_that_come_together_are_written_as_one_record(nats_server):
    bus, ledger = await opened(nats_server)
    try:
        burst = [Dropped(f"g-{n}", "no_reward_variance", "workflow", 8) for n in range(10)]
        await asyncio.wait_for(asyncio.gather(*(ledger.add_dropped(d) for d in burst)), 30)
        assert len(await keys(ledger)) == 1, "ten drops on one tick: one write"
        await asyncio.wait_for(ledger.add_dropped(Dropped("s-1", "dead_letter:reward", "gateway", 3)), 30)
        state = await ledger.load()
        assert len(await keys(ledger)) == 2
        assert state.dropped == {d.group_id: d for d in [*burst, Dropped("s-1", "dead_letter:reward", "gateway", 3)]}
    finally:
        await bus.close()


async def test_a_failed_drops_write_fails_every_drop_in_it_and_the_next_one_writes(nats_server, monkeypatch):
    bus, ledger = await opened(nats_server)
    try:
        real_put = ledger._put
        calls = []

        async def put_once_failing(key, value):
            calls.append(key)
            if len(calls) == 1:
                raise TimeoutError("nats away")
            await real_put(key, value)

        monkeypatch.setattr(ledger, "_put", put_once_failing)
        results = await asyncio.wait_for(asyncio.gather(
            *(ledger.add_dropped(Dropped(f"g-{n}", "stale", "workflow", 8)) for n in range(3)),
            return_exceptions=True), 30)
        assert all(isinstance(r, TimeoutError) for r in results), results
        await asyncio.wait_for(ledger.add_dropped(Dropped("g-0", "stale", "workflow", 8)), 30)
        assert set((await ledger.load()).dropped) == {"g-0"}, "nothing of the failed record was stored"
    finally:
        await bus.close()


async def test_the_issued_record_and_what_older_builders_wrote(nats_server):
    bus, ledger = await opened(nats_server)
    try:
        await ledger.set_issued(9, 2, chunk_start=5)
        state = await ledger.load()
        assert (state.issued, state.refills, state.chunk_start) == (9, 2, 5)
        kv = await bus.js.key_value(BUCKET)   # as a builder before the chunked ledger left it
        await kv.put("issued", b"12")
        await kv.put("refills", json.dumps(4).encode())
        await kv.put("dropped.g-3", json.dumps({"group_id": "g-3", "reason": "stale", "source": "workflow",
                                                "trajectories": 8}).encode())
        state = await ledger.load()
        assert (state.issued, state.refills, state.chunk_start) == (12, 4, 11), "its last group was its chunk"
        assert state.dropped == {"g-3": Dropped("g-3", "stale", "workflow", 8)}
    finally:
        await bus.close()
