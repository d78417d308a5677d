"""F4: an issued group that can never complete (TRAJ over its byte cap discarded a trajectory, a work item lost)
is dropped with reason "timeout" `group_timeout_s` after its issue, so its budget slot comes back and the run
does not stall; complete groups and young ones are left alone; a member arriving later is acked and ignored. And
the real cause: TRAJ at the least budget discards unacked trajectories (limits retention, DiscardOld)."""

from __future__ import annotations

import time

import pytest

from services.builder.config import BuilderConfig
from services.common.bus import MIN_MAX_BYTES, SUBJECT_TRAJ_RAW, Bus
from services.common.contracts import data_pb2
from tests.builder.test_flush_reliability import FakeMsg, recovered, shut, traj


async def test_incomplete_groups_time_out_and_give_their_slots_back(nats_server):
    bus = await Bus.connect(nats_server.url, name="builder")
    builder, stop = await recovered(bus, group_timeout_s=60.0)
    try:
        assert await builder.issue_once() and builder.issued == 4  # version 0, eta 1: (0 + 1 + 1) * 2 groups
        assert builder.budget.capacity() == 0 and not await builder.issue_once()
        half = FakeMsg()
        await builder.handle_scored(traj("g-1", 0, source="workflow"), half)  # one of two members
        for i in range(2):
            await builder.handle_scored(traj("g-2", i, source="workflow"), FakeMsg())  # complete
        now = time.monotonic()
        assert await builder.drop_expired(now + 30) == 0  # young: kept
        assert await builder.drop_expired(now + 61) == 3  # g-0 and g-3 (nothing came), g-1 (half)
        dropped = (await builder.ledger.load()).dropped
        assert {g: d.reason for g, d in dropped.items()} == {"g-0": "timeout", "g-1": "timeout", "g-3": "timeout"}
        assert half.acked and "g-2" not in dropped and "g-2" in builder.in_flight_since  # complete: waits to batch
        assert builder.budget.capacity() == 3 and await builder.issue_once()
        late = FakeMsg()
        await builder.handle_scored(traj("g-1", 1, source="workflow"), late)  # arrives after the drop
        assert late.acked and "g-1" not in builder.assembler.known
    finally:
        await shut(builder, stop, bus)


async def test_a_restarted_builder_times_out_groups_it_recovered_in_flight(nats_server):
    bus = await Bus.connect(nats_server.url, name="builder")
    first, stop1 = await recovered(bus)
    assert await first.issue_once() and first.issued == 4   # one chunk: the budget's four slots
    await shut(first, stop1, bus)
    bus2 = await Bus.connect(nats_server.url, name="builder-2")
    second, stop2 = await recovered(bus2, group_timeout_s=60.0)
    try:
        assert set(second.in_flight_since) == {"g-0", "g-1", "g-2", "g-3"}
        assert await second.drop_expired(time.monotonic() + 61) == 4
        assert second.budget.in_flight == 0
    finally:
        await shut(second, stop2, bus2)


def test_group_timeout_is_checked():
    with pytest.raises(ValueError, match="group_timeout_s"):
        BuilderConfig(group_timeout_s=0)


async def test_traj_at_the_least_budget_discards_unacked_trajectories_and_the_builder_says_so(nats_server):
    """Why the deadline is needed: a limits stream over its byte cap deletes its oldest messages acked or not,
    so trajectories no consumer has seen yet are gone without a dead letter. The builder notices and says so."""
    bus = await Bus.connect(nats_server.url, name="rollout", max_bytes=MIN_MAX_BYTES)
    builder, stop = await recovered(await Bus.connect(nats_server.url, name="builder", max_bytes=MIN_MAX_BYTES))
    try:
        assert await builder.check_traj() == 0
        payload = [70_000] * 100_000  # ~0.3 MB each (3-byte varints)
        for i in range(100):     # ~30 MB into a ~19 MiB TRAJ, no reward consumer reading
            t = data_pb2.Trajectory(trajectory_id=f"t{i}", group_id=f"g-{i // 2}", completion_ids=payload)
            await bus.publish(SUBJECT_TRAJ_RAW, t, t.trajectory_id)
        state = (await bus.js.stream_info("TRAJ")).state
        assert state.first_seq > 1 and state.messages < 100
        assert await builder.check_traj() == state.first_seq - 1 and builder.traj_discarded > 0
    finally:
        await shut(builder, stop, builder.bus)
        await bus.close()


async def test_an_eval_round_missing_results_ends_at_the_deadline_counting_them_wrong(nats_server):
    bus = await Bus.connect(nats_server.url, name="builder")
    builder, stop = await recovered(bus, group_timeout_s=60.0)
    try:
        rnd = await builder.issue_eval(0)
        assert not rnd.complete and builder.evals.pending
        assert rnd.expected == 3
        builder.evals.record(rnd.round_id, "t-a", 1.0, [0])  # one of three results came
        await builder.drop_expired(time.monotonic() + 61)
        assert rnd.complete and not builder.evals.pending
        assert rnd.accuracy == 1 / 3  # the two missing count as wrong
    finally:
        await shut(builder, stop, bus)
