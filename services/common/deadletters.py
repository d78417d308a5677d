"""Dead-letter counts for every service's Status and Prometheus metrics, refreshed in the background."""

from __future__ import annotations

import asyncio

import prometheus_client

from services.common.bus import Bus
from services.common.logging import get_logger
from services.common.runtime import sleep_or_stop

DEAD_LETTERS = prometheus_client.Gauge("meshrl_dead_letters", "Messages in the DLQ stream, by consumer", ["consumer"])


class DeadLetterWatch:
    """`counts` is the DLQ stream's message count by consumer, at most `every` seconds old."""

    def __init__(self, bus: Bus, every: float = 10.0) -> None:
        self.bus = bus
        self.every = every
        self.counts: dict[str, int] = {}

    async def refresh(self) -> dict[str, int]:
        self.counts = await self.bus.dead_letter_counts()
        for consumer, n in self.counts.items():
            DEAD_LETTERS.labels(consumer).set(n)
        return self.counts

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.refresh()
            except Exception as exc:  # noqa: BLE001 - a status figure never takes a service down
                get_logger().debug("dead_letter_count_failed", error=repr(exc))
            await sleep_or_stop(stop, self.every)
