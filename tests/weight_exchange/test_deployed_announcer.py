"""F17: DEPLOYED for the final version is no longer fire-once. A publish lost while NATS is away does not fail
the Sync, and the announcer publishes the newest deployed version again until it lands (real nats-server, stopped
and started again on the same port and store)."""

from __future__ import annotations

import asyncio
import time

from services.common.bus import Bus
from services.common.contracts import data_pb2
from services.weight_exchange.announce import DeployedAnnouncer


async def deployed_versions(bus: Bus) -> list[int]:
    info = await bus.js.stream_info("EVENTS")
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
        event = data_pb2.VersionEvent.FromString((await bus.js.get_msg("EVENTS", seq)).data)
        if event.kind == data_pb2.VERSION_KIND_DEPLOYED:
            out.append(event.version)
    return out


async def test_a_deployed_event_lost_to_a_nats_outage_is_announced_again(nats_server):
    bus = await Bus.connect(nats_server.url, name="weight_exchange")
    announcer = DeployedAnnouncer(bus, every=0.5, publish_deadline=2.0)
    stop = asyncio.Event()
    task = asyncio.create_task(announcer.run(stop))
    try:
        await announcer.deployed(3)
        assert announcer.announced == 3
        nats_server.stop()
        t0 = time.monotonic()
        await announcer.deployed(4)  # the final Sync's event: NATS is away
        assert time.monotonic() - t0 < 10 and announcer.announced == 3  # the Sync is not held up, nor failed
        nats_server.start()
        for _ in range(200):
            if announcer.announced == 4:
                break
            await asyncio.sleep(0.1)
        assert announcer.announced == 4
        assert 4 in await deployed_versions(bus)
        assert max(await deployed_versions(bus)) == 4
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await bus.close()
