"""`follow()` hands a message to its handler again when the handler failed for a reason a retry can fix, and
the builder's dead-letter handler, which follows DLQ, is safe to run again (real nats-server)."""

from __future__ import annotations

import asyncio

from services.builder.ledger import Dropped
from services.common import trajectory_groups
from services.common.bus import SUBJECT_VERSIONS, Bus, decoder, follow
from services.common.contracts import data_pb2
from tests.builder.test_flush_reliability import FakeMsg, fail_once, recovered, shut, traj
from tests.builder.test_restart import until


async def test_a_handler_that_fails_once_gets_the_same_message_again(nats_server):
    bus = await Bus.connect(nats_server.url, name="follower")
    for i in range(3):
        event = data_pb2.VersionEvent(event_id=f"e-{i}", version=i, kind=data_pb2.VERSION_KIND_TRAINED)
        await bus.publish(SUBJECT_VERSIONS, event, event.event_id)
    seen: list[str] = []

    def handle(event: data_pb2.VersionEvent) -> None:
        seen.append(event.event_id)
        if seen == ["e-0", "e-1"]:
            raise TimeoutError("nats away")  # e-1 failed: it comes again, then e-2
        if event.event_id == "bad":
            raise ValueError("bad: never fixable")  # skipped

    stop = asyncio.Event()
    task = asyncio.create_task(follow(bus, SUBJECT_VERSIONS, decoder(data_pb2.VersionEvent), handle, stop))
    try:
        await until(lambda: len(seen) >= 4, "e-1 again and e-2", timeout=20)
        bad = data_pb2.VersionEvent(event_id="bad", version=9, kind=data_pb2.VERSION_KIND_TRAINED)
        await bus.publish(SUBJECT_VERSIONS, bad, bad.event_id)
        last = data_pb2.VersionEvent(event_id="e-3", version=3, kind=data_pb2.VERSION_KIND_TRAINED)
        await bus.publish(SUBJECT_VERSIONS, last, last.event_id)
        await until(lambda: "e-3" in seen, "e-3 after the skipped one", timeout=20)
        assert seen == ["e-0", "e-1", "e-1", "e-2", "bad", "e-3"]
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)
        await bus.close()


async def test_a_dead_letter_whose_drop_failed_once_is_dropped_on_the_retry(nats_server, monkeypatch):
    """The drop's ledger write fails: the group stays tracked, so the retry drops it whole (acks, budget)."""
    bus = await Bus.connect(nats_server.url, name="builder")
    builder, stop = await recovered(bus)
    try:
        assert builder.budget.try_issue()
        builder.issued = 1
        acks = [FakeMsg(), FakeMsg()]
        await builder.handle_scored(traj("g-0", 0, source="workflow"), acks[0])
        await builder.handle_scored(traj("g-0", 1, source="workflow"), acks[1])  # complete, accepted, ready
        assert builder.budget.accepted == 1 and builder.budget.in_flight == 0
        letter = data_pb2.DeadLetter(subject="traj.scored", consumer="trainer", reason="test",
                                     data=traj("g-0", 1, source="workflow").SerializeToString())
        calls = fail_once(monkeypatch, builder.ledger, "add_dropped", TimeoutError("nats away"))
        try:
            await builder.handle_dead_letter(letter)
        except TimeoutError:
            pass
        await builder.handle_dead_letter(letter)  # what follow() now does after a failure
        assert len(calls) == 2 and "g-0" in builder.consumed_groups and all(a.acked for a in acks)
        assert builder.budget.accepted == 0 and builder.budget.dropped == 1 and builder.budget.in_flight == 0
        dropped = (await builder.ledger.load()).dropped
        assert dropped["g-0"] == Dropped("g-0", "dead_letter:trainer", "workflow", 2)
    finally:
        await shut(builder, stop, bus)


async def test_a_dead_letter_for_a_group_never_issued_frees_no_slot(nats_server):
    """The builder's own "never issued" letters come back on DLQ: nothing to drop (before, the drop took a slot
    of another group, or raised now that follow() retries)."""
    bus = await Bus.connect(nats_server.url, name="builder")
    builder, stop = await recovered(bus)
    try:
        assert builder.budget.try_issue()
        builder.issued = 1
        letter = data_pb2.DeadLetter(subject="traj.scored", consumer="builder", reason="never issued",
                                     data=traj("g-999", 0, source="workflow").SerializeToString())
        await builder.handle_dead_letter(letter)
        assert builder.budget.in_flight == 1 and builder.budget.dropped == 0 and builder.groups_dropped == 0
        assert not (await builder.ledger.load()).dropped
    finally:
        await shut(builder, stop, bus)


async def test_a_dead_lettered_bundle_drops_each_of_its_groups(nats_server):
    """The reward service dead-letters a rollout's bundle whole (a member can never be scored): every group in it
    can no longer complete, so each is dropped and gives its slot back."""
    bus = await Bus.connect(nats_server.url, name="builder")
    builder, stop = await recovered(bus)
    try:
        for _ in range(3):
            assert builder.budget.try_issue()
        builder.issued = 3
        groups = [trajectory_groups.of([traj(f"g-{n}", k, source="workflow") for k in range(2)]) for n in (0, 2)]
        letter = data_pb2.DeadLetter(subject="traj.raw", consumer="reward", reason="cannot be decoded",
                                     type=trajectory_groups.BUNDLE_TYPE,
                                     data=data_pb2.TrajectoryBundle(groups=groups).SerializeToString())
        await builder.handle_dead_letter(letter)
        dropped = (await builder.ledger.load()).dropped
        assert set(dropped) == {"g-0", "g-2"} and dropped["g-2"].reason == "dead_letter:reward"
        assert builder.budget.in_flight == 1 and builder.budget.dropped == 2 and builder.groups_dropped == 2
    finally:
        await shut(builder, stop, bus)
