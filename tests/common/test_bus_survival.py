"""The data plane through failures (real nats-server): deliveries exhausted by dead processes end in the DLQ
with a reason, a publish and a consumer ride out a server that is gone for a while, big batches go out of band."""

from __future__ import annotations

import asyncio

import pytest

from services.common.batches import BatchConflict, blob_name, publish_batch, published_batches, read_batch
from services.common.bus import CONSUMERS, SUBJECT_TRAJ_RAW, Bus, consume, decoder
from services.common.contracts import data_pb2
from tests.common.test_bus import collect, dead_letters, traj

ACK_WAIT = 1.0


async def test_a_message_whose_consumers_keep_dying_is_dead_lettered_with_the_reason(nats_server):
    bus = await Bus.connect(nats_server.url, name="test", ack_wait=ACK_WAIT)
    try:
        await bus.publish(SUBJECT_TRAJ_RAW, traj("cursed"), "cursed")
        sub = await bus.js.pull_subscribe_bind(durable="reward", stream="TRAJ")
        for _ in range(CONSUMERS["reward"].max_deliver):  # each delivery dies with its process: never acked
            (msg,) = await sub.fetch(1, timeout=10)
            assert msg.data
            await asyncio.sleep(ACK_WAIT + 0.3)
        await sub.unsubscribe()
        await bus.publish(SUBJECT_TRAJ_RAW, traj("fine"), "fine")
        got = await collect(bus, "reward", 1)
        assert [t.trajectory_id for t in got] == ["fine"]
        (letter,) = await dead_letters(bus, "reward", 1)
        assert "not acked after 5 deliveries" in letter.reason
        assert data_pb2.Trajectory.FromString(letter.data).trajectory_id == "cursed"
        assert await bus.dead_letter_counts() == {"reward": 1}
    finally:
        await bus.close()


async def test_publish_and_consume_ride_out_a_server_that_is_gone(nats_server):
    bus = await Bus.connect(nats_server.url, name="test")
    stop = asyncio.Event()
    got: list[str] = []

    async def handle(t: data_pb2.Trajectory) -> None:
        got.append(t.trajectory_id)

    task = asyncio.create_task(consume(bus, "reward", decoder(data_pb2.Trajectory), handle, stop))
    try:
        await bus.publish(SUBJECT_TRAJ_RAW, traj("before"), "before")
        for _ in range(200):  # acked before the server goes (an ack lost with it would redeliver "before")
            info = await bus.js.consumer_info("TRAJ", "reward")
            if got == ["before"] and info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.05)
        nats_server.proc.kill()
        nats_server.proc.wait(30)

        async def restart_later() -> None:
            await asyncio.sleep(4.0)
            nats_server.start()  # same port, same store

        restarter = asyncio.create_task(restart_later())
        # waits the 4-s outage out (the bus's own deadline is minutes: this test's is one)
        assert await asyncio.wait_for(bus.publish(SUBJECT_TRAJ_RAW, traj("during"), "during"), 60) is True
        await asyncio.wait_for(restarter, 30)
        for _ in range(200):
            if "during" in got:
                break
            await asyncio.sleep(0.1)
        assert got == ["before", "during"]
        assert not task.done(), "the consume loop must not exit on a lost server"
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        await bus.close()


async def test_a_batch_over_max_payload_is_stored_out_of_band_and_read_back_whole(nats_server):
    bus = await Bus.connect(nats_server.url, name="test")
    try:
        trajectories = [data_pb2.Trajectory(trajectory_id=f"t{i}", group_id=f"g{i // 2}", completion_ids=[70_000] * 50_000)
                        for i in range(8)]
        batch = data_pb2.TrainingBatch(batch_id="batch-0", index=0, trajectories=trajectories,
                                       group_ids=[f"g{i}" for i in range(4)])
        assert batch.ByteSize() > bus.max_payload
        assert await publish_batch(bus, batch) is True
        assert await publish_batch(bus, batch) is False  # idempotent by index
        back = await read_batch(bus, 0)
        assert back == batch
        assert await read_batch(bus, 1) is None
        (summary,) = await published_batches(bus)
        assert summary.index == 0 and summary.group_ids == ("g0", "g1", "g2", "g3")
    finally:
        await bus.close()


async def test_an_index_holds_one_batch_whatever_the_dedupe_window(nats_server):
    """Two builders (or a late retry past the 120-s dedupe window, the same check) cannot put a second, different
    batch under an index: the subject must be empty. The same batch again is a duplicate. Out-of-band blobs of two
    different batches never share a name."""
    bus = await Bus.connect(nats_server.url, name="test")
    try:
        ours = data_pb2.TrainingBatch(batch_id="batch-3", index=3, group_ids=["g0", "g1"])
        theirs = data_pb2.TrainingBatch(batch_id="batch-3", index=3, group_ids=["g2", "g5"])
        assert await publish_batch(bus, ours) is True
        assert await publish_batch(bus, ours) is False
        with pytest.raises(BatchConflict, match="second builder"):
            await publish_batch(bus, theirs)
        assert (await read_batch(bus, 3)).group_ids == ["g0", "g1"]
        assert blob_name(ours) != blob_name(theirs) and blob_name(ours) == blob_name(ours)
        # out of band: the pointer's blob is the first batch's, whatever the second one tried
        big = [data_pb2.Trajectory(trajectory_id=f"t{i}", group_id="g9", completion_ids=[70_000] * 50_000)
               for i in range(8)]
        first = data_pb2.TrainingBatch(batch_id="batch-4", index=4, trajectories=big, group_ids=["g9"])
        second = data_pb2.TrainingBatch(batch_id="batch-4", index=4, trajectories=big[:7], group_ids=["g8"])
        assert await publish_batch(bus, first) is True
        with pytest.raises(BatchConflict):
            await publish_batch(bus, second)
        assert await read_batch(bus, 4) == first
    finally:
        await bus.close()
