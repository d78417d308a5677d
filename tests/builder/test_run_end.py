"""F18: RUN_END (what stops `make run`'s stack) waits for the trainer's final checkpoint, so a final/ still being
written is not cut off; a trainer that never writes one delays it by final_checkpoint_timeout_s at most."""

from __future__ import annotations

import asyncio

from services.common.bus import SUBJECT_VERSIONS, Bus
from services.common.contracts import data_pb2
from tests.builder.test_flush_reliability import recovered, shut


async def run_end_published(bus: Bus) -> bool:
    try:
        await bus.js.get_last_msg("EVENTS", SUBJECT_VERSIONS)
    except Exception:  # noqa: BLE001 - no event at all
        return False
    info = await bus.js.stream_info("EVENTS")
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        event = data_pb2.VersionEvent.FromString((await bus.js.get_msg("EVENTS", seq)).data)
        if event.kind == data_pb2.VERSION_KIND_RUN_END:
            return True
    return False


async def test_run_end_waits_for_the_final_checkpoint(nats_server):
    bus = await Bus.connect(nats_server.url, name="builder")
    builder, stop = await recovered(bus, final_checkpoint_timeout_s=600.0)
    try:
        await builder._publish_run_end(4, {"eval_accuracy": 0.5})
        await asyncio.sleep(0.5)
        assert not builder.finished.is_set() and not await run_end_published(bus)
        checkpoint = data_pb2.VersionEvent(event_id="checkpoint-4-v4", version=4,
                                           kind=data_pb2.VERSION_KIND_CHECKPOINT, checkpoint_path="/r/checkpoints/v4")
        await bus.publish(SUBJECT_VERSIONS, checkpoint, checkpoint.event_id)
        await asyncio.sleep(0.5)
        assert not builder.finished.is_set()  # a resumable checkpoint is not the final one
        final = data_pb2.VersionEvent(event_id="checkpoint-4-final", version=4,
                                      kind=data_pb2.VERSION_KIND_CHECKPOINT, checkpoint_path="/r/final")
        await bus.publish(SUBJECT_VERSIONS, final, final.event_id)
        await asyncio.wait_for(builder.finished.wait(), 10)
        assert await run_end_published(bus)
    finally:
        await shut(builder, stop, bus)


async def test_without_a_final_checkpoint_run_end_comes_after_the_timeout(nats_server):
    bus = await Bus.connect(nats_server.url, name="builder")
    builder, stop = await recovered(bus, final_checkpoint_timeout_s=1.0)
    try:
        await builder._publish_run_end(4, {})
        assert not builder.finished.is_set()
        await asyncio.sleep(1.1)
        await builder._end_when_checkpointed()  # the keep-alive loop's tick
        assert builder.finished.is_set() and await run_end_published(bus)
    finally:
        await shut(builder, stop, bus)
