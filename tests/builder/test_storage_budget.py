"""F5: the builder's object store (out-of-band batches) and ledger are inside nats_max_bytes, and the blobs of
batches no trainer reads again are deleted once two checkpoints cover them (real nats-server)."""

from __future__ import annotations

import asyncio

import pytest

from services.builder.ledger import BUCKET
from services.common.batches import BLOBS, publish_batch, read_batch
from services.common.bus import BLOBS_SHARE, IMAGES_SHARE, LEDGER_SHARE, STREAMS, SUBJECT_VERSIONS, Bus, InvalidMessage
from services.common.contracts import data_pb2
from tests.builder.test_flush_reliability import recovered, shut

BUDGET = 256 << 20


def big_batch(index: int) -> data_pb2.TrainingBatch:
    """Over max_payload: stored out of band."""
    trajectories = [data_pb2.Trajectory(trajectory_id=f"b{index}-{i}", group_id=f"g{index}",
                                        completion_ids=[70_000] * 50_000) for i in range(8)]
    return data_pb2.TrainingBatch(batch_id=f"batch-{index}", index=index, trajectories=trajectories,
                                  group_ids=[f"g{index}"])


def test_the_shares_split_the_whole_budget():
    assert sum(s.share for s in STREAMS) + BLOBS_SHARE + IMAGES_SHARE + LEDGER_SHARE == pytest.approx(1.0)


async def test_the_blob_store_and_the_ledger_are_capped_inside_the_budget(nats_server):
    bus = await Bus.connect(nats_server.url, name="builder", max_bytes=BUDGET)
    builder, stop = await recovered(bus)
    try:
        await publish_batch(bus, big_batch(0))  # creates the object store
        caps = {s.config.name: s.config.max_bytes for s in await bus.js.streams_info()}
        assert caps[f"OBJ_{BLOBS}"] == int(BLOBS_SHARE * BUDGET)
        assert caps[f"KV_{BUCKET}"] == int(LEDGER_SHARE * BUDGET)
        assert sum(v for v in caps.values() if v > 0) <= BUDGET
    finally:
        await shut(builder, stop, bus)


async def checkpoint(bus: Bus, version: int) -> None:
    event = data_pb2.VersionEvent(event_id=f"checkpoint-{version}-v{version}", version=version,
                                  kind=data_pb2.VERSION_KIND_CHECKPOINT, checkpoint_path=f"/x/v{version}")
    await bus.publish(SUBJECT_VERSIONS, event, event.event_id)


async def test_blobs_go_once_two_checkpoints_cover_their_batches(nats_server):
    bus = await Bus.connect(nats_server.url, name="builder", max_bytes=BUDGET)
    builder, stop = await recovered(bus)
    try:
        for index in range(4):
            assert await publish_batch(bus, big_batch(index))
        await checkpoint(bus, 2)
        await asyncio.sleep(1.0)
        assert [await read_batch(bus, i) is not None for i in range(4)] == [True] * 4  # one checkpoint: kept
        await checkpoint(bus, 3)
        store = await bus.js.object_store(BLOBS)
        for _ in range(100):
            names = {o.name.split("-")[1] for o in await store.list(ignore_deletes=True)}
            if names == {"2", "3"}:
                break
            await asyncio.sleep(0.1)
        assert names == {"2", "3"}  # under the older of the two newest checkpoints (v2): gone
        with pytest.raises(InvalidMessage, match="is gone"):
            await read_batch(bus, 1)
        assert (await read_batch(bus, 2)).group_ids == ["g2"]
    finally:
        await shut(builder, stop, bus)
    # a restarted builder replays the checkpoints and prunes nothing it should keep
    bus = await Bus.connect(nats_server.url, name="builder", max_bytes=BUDGET)
    builder, stop = await recovered(bus)
    try:
        await builder.prune_blobs()
        assert builder.checkpoints == [2, 3]
        assert (await read_batch(bus, 3)).group_ids == ["g3"]
    finally:
        await shut(builder, stop, bus)
