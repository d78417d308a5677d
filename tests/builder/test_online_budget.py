"""The online budget the builder announces to the gateway: the pure numbers, then a builder on a real nats-server."""

from __future__ import annotations

import asyncio

import pytest

from services.builder.admission import OnlineBudget
from services.builder.config import BuilderConfig
from services.builder.server import Builder
from services.common.bus import SUBJECT_TRAJ_SCORED, SUBJECT_VERSIONS, Bus, decoder, follow
from services.common.contracts import data_pb2

pytestmark = pytest.mark.timeout(120)


def test_limit_ids_and_metrics():
    b = OnlineBudget(batch_size=4, max_staleness=2)
    assert b.limit == 12 and b.event_id == "budget-0-0"
    b.on_version(3)
    b.on_version(1)  # versions never go back
    b.released, b.arrived = 5, 9
    assert b.limit == 24 and b.event_id == "budget-3-5"
    assert b.metrics() == {"limit_groups": 24.0, "released_groups": 5.0, "arrived_groups": 9.0, "eta": 2.0,
                           "batch_size": 4.0}


@pytest.mark.parametrize("field", ["batch_size", "max_staleness"])
def test_bad_settings_name_the_field(field):
    with pytest.raises(ValueError, match=field):
        OnlineBudget(**{"batch_size": 1, "max_staleness": 0, field: -1})


def gateway_traj(gid: str, version: int) -> data_pb2.Trajectory:
    return data_pb2.Trajectory(trajectory_id=f"t-{gid}", group_id=gid, group_size=1, completion_ids=[1],
                               versions=[version], behavior_logprobs=[-1.0], loss_mask=[1], source="gateway",
                               split="train", scored=True)


async def until(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def make_builder(bus: Bus, source: str) -> Builder:
    config = BuilderConfig(source=source, batch_size=2, group_size=1, max_staleness=0, eval_size=2, train_size=4)
    return Builder(config, bus, lambda text: [1, 2], [0])


async def test_online_builder_announces_start_versions_and_stale_releases(nats_server):
    bus = await Bus.connect(nats_server.url, name="test")
    stop = asyncio.Event()
    seen: list[data_pb2.VersionEvent] = []
    watcher = asyncio.create_task(follow(bus, SUBJECT_VERSIONS, decoder(data_pb2.VersionEvent), seen.append, stop))
    builder = make_builder(bus, "online")
    tasks = builder.start(stop)

    def budgets() -> list[tuple[str, int, dict]]:
        return [(e.event_id, e.version, dict(e.metrics)) for e in seen if e.kind == data_pb2.VERSION_KIND_BUDGET]

    try:
        await until(lambda: len(budgets()) == 1, "the start announcement")
        assert budgets()[0] == ("budget-0-0", 0, {"limit_groups": 2.0, "released_groups": 0.0, "arrived_groups": 0.0,
                                                  "eta": 0.0, "batch_size": 2.0})
        first = next(e for e in seen if e.kind == data_pb2.VERSION_KIND_BUDGET).budget   # the typed announcement
        assert (first.limit_groups, first.released_groups, first.arrived_groups, first.eta, first.batch_size) == \
            (2, 0, 0, 0, 2)
        trained = data_pb2.VersionEvent(event_id="trained-1", version=1, kind=data_pb2.VERSION_KIND_TRAINED)
        await bus.publish(SUBJECT_VERSIONS, trained, trained.event_id)
        await asyncio.sleep(0.5)
        assert len(budgets()) == 1, "trained but not deployed: new groups would still sample version 0"
        deployed = data_pb2.VersionEvent(event_id="deployed-1", version=1, kind=data_pb2.VERSION_KIND_DEPLOYED)
        await bus.publish(SUBJECT_VERSIONS, deployed, deployed.event_id)
        await until(lambda: len(budgets()) == 2, "the announcement after version 1 is deployed")
        assert budgets()[1][:2] == ("budget-1-0", 1) and budgets()[1][2]["limit_groups"] == 4.0

        for gid in ("a", "b"):  # fresh for batch 0: trained, no release
            await bus.publish(SUBJECT_TRAJ_SCORED, gateway_traj(gid, 0), f"t-{gid}")
        await until(lambda: builder.batches_published == 1, "batch 0")
        for gid in ("c", "d"):  # batch 1 trains at version 1: eta 0 makes version-0 groups stale
            await bus.publish(SUBJECT_TRAJ_SCORED, gateway_traj(gid, 0), f"t-{gid}")
        await until(lambda: len(budgets()) == 3, "the announcement after stale drops")
        event_id, version, metrics = budgets()[2]
        assert (event_id, version) == ("budget-1-2", 1)
        assert metrics["released_groups"] == 2.0 and metrics["arrived_groups"] == 4.0 and metrics["limit_groups"] == 4.0
        assert builder.dropped_stale == 2 and builder.batches_published == 1

        await bus.publish(SUBJECT_VERSIONS, deployed, "deployed-1-again")  # a repeated version: same id, deduped
        await asyncio.sleep(0.5)
        assert len(budgets()) == 3
    finally:
        stop.set()
        await asyncio.gather(*tasks, watcher, return_exceptions=True)
        await bus.close()


async def test_dataset_builder_announces_no_budget(nats_server):
    bus = await Bus.connect(nats_server.url, name="test")
    builder = make_builder(bus, "dataset")
    try:
        await builder.handle_version(data_pb2.VersionEvent(event_id="v1", version=1, kind=data_pb2.VERSION_KIND_TRAINED))
        info = await bus.js.stream_info("EVENTS")
        assert builder.online is None and info.state.messages == 0
    finally:
        await bus.close()
