"""The rollout service feeds the builder's budget events to its gateway: every replica, from the stream's start."""

from __future__ import annotations

import asyncio

import pytest

from services.common.bus import SUBJECT_VERSIONS, Bus
from services.common.contracts import data_pb2
from services.rollout.gateway.budget import GroupBudget
from services.rollout.server import follow_budget

pytestmark = pytest.mark.timeout(60)


def budget_event(version: int, limit: int, released: int, arrived: int = 0) -> data_pb2.VersionEvent:
    return data_pb2.VersionEvent(event_id=f"budget-{version}-{released}", version=version,
                                 kind=data_pb2.VERSION_KIND_BUDGET,
                                 budget=data_pb2.OnlineBudget(limit_groups=limit, released_groups=released,
                                                              arrived_groups=arrived, eta=1, batch_size=4))


async def until(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_every_replica_and_a_restarted_one_get_the_latest_budget(nats_server):
    bus = await Bus.connect(nats_server.url, name="test")
    stop = asyncio.Event()
    replicas = [GroupBudget(), GroupBudget()]
    tasks = []
    try:
        await bus.publish(SUBJECT_VERSIONS, budget_event(0, 4, 0), "budget-0-0")  # before anyone listens
        tasks = [asyncio.create_task(follow_budget(bus, b, stop)) for b in replicas]
        await until(lambda: all(b.limit == 4 for b in replicas), "the event published before the replicas started")

        trained = data_pb2.VersionEvent(event_id="t1", version=1, kind=data_pb2.VERSION_KIND_TRAINED,
                                        metrics={"limit_groups": 999})
        await bus.publish(SUBJECT_VERSIONS, trained, "t1")  # not a budget event: ignored
        await bus.nc.publish(SUBJECT_VERSIONS, b"\xff not protobuf")  # skipped, the feed goes on
        broken = data_pb2.VersionEvent(event_id="b", kind=data_pb2.VERSION_KIND_BUDGET, metrics={"limit_groups": 99})
        await bus.publish(SUBJECT_VERSIONS, broken, "b")  # floats in the generic map, no typed budget: skipped
        await bus.publish(SUBJECT_VERSIONS, budget_event(1, 8, 3, 5), "budget-1-3")
        await until(lambda: all(b.limit == 8 for b in replicas), "the second budget event on both replicas")
        assert all((b.released, b.arrived) == (3, 5) for b in replicas)
        assert replicas[0].capacity() == 8 + 3 - 5

        restarted = GroupBudget()
        tasks.append(asyncio.create_task(follow_budget(bus, restarted, stop)))
        await until(lambda: restarted.limit == 8, "the latest budget after a restart")
        assert (restarted.released, restarted.arrived) == (3, 5)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        await bus.close()
