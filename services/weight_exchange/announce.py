"""DEPLOYED events: which policy version the inference ranks hold, for the builder (new agent groups sample at it,
the final eval waits for it).

Published after each successful Sync, and again every `every` seconds for the newest version, under the same
event id (the stream deduplicates inside its window; the builder keeps the highest version it saw): a publish
lost to NATS being away right after the final Sync is made up later, instead of leaving the final eval, and so
the run, waiting forever. A publish that fails does not fail the Sync: the weights did arrive.
"""

from __future__ import annotations

import asyncio

from services.common.bus import SUBJECT_VERSIONS, TRANSIENT, Bus
from services.common.contracts import data_pb2
from services.common.ids import now
from services.common.logging import get_logger
from services.common.runtime import sleep_or_stop


class DeployedAnnouncer:
    def __init__(self, bus: Bus, *, every: float = 30.0, publish_deadline: float = 10.0) -> None:
        self.bus = bus
        self.every = every
        self.publish_deadline = publish_deadline
        self.version = -1      # the newest version a Sync deployed
        self.announced = -1    # the newest version a publish confirmed

    async def deployed(self, version: int) -> None:
        self.version = max(self.version, version)
        await self._announce()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            stopped = await sleep_or_stop(stop, self.every)
            if self.version >= 0 and not stopped:
                await self._announce()

    async def _announce(self) -> None:
        version = self.version
        event = data_pb2.VersionEvent(event_id=f"deployed-{version}", version=version,
                                      kind=data_pb2.VERSION_KIND_DEPLOYED, at=now())
        try:
            await asyncio.wait_for(self.bus.publish(SUBJECT_VERSIONS, event, event.event_id,
                                                    deadline=self.publish_deadline), self.publish_deadline)
        except TRANSIENT as exc:
            get_logger().warning("deployed_publish_failed", version=version, retry_in=self.every, error=repr(exc))
            return
        self.announced = max(self.announced, version)
