"""The builder reads traj.scored as group messages (real nats-server): a group's members in one message complete it
in one delivery, and that message is acked once, when its group is batched; a message with a member that can never
be trained holds none of them."""

from __future__ import annotations

import math

import pytest

from services.common import trajectory_groups
from services.common.bus import Bus, InvalidMessage
from tests.builder.test_flush_reliability import recovered, shut, traj


class CountingMsg:
    def __init__(self) -> None:
        self.acks = 0

    async def ack(self) -> None:
        self.acks += 1

    async def in_progress(self) -> None:
        pass


async def test_a_group_message_completes_its_group_and_is_acked_once_when_batched(nats_server):
    bus = await Bus.connect(nats_server.url, name="builder")
    builder, stop = await recovered(bus, batch_size=2)
    try:
        first, second = CountingMsg(), CountingMsg()
        await builder.handle_group(trajectory_groups.of([traj("s-0", 0), traj("s-0", 1)]), first)
        assert builder.received == 2 and builder.batches_published == 0 and first.acks == 0  # held, kept alive
        assert builder.assembler.held() == [first]
        await builder.handle_group(trajectory_groups.of([traj("s-1", 0), traj("s-1", 1)]), second)
        assert builder.batches_published == 1 and (first.acks, second.acks) == (1, 1)
        redelivered = CountingMsg()
        await builder.handle_group(trajectory_groups.of([traj("s-1", 1), traj("s-1", 0)]), redelivered)
        assert redelivered.acks == 1 and builder.received == 4  # a batched group's again: acked, not counted

        bad = CountingMsg()
        with pytest.raises(InvalidMessage, match="reward"):
            await builder.handle_group(trajectory_groups.of([traj("s-2", 0), traj("s-2", 1, reward=math.inf)]), bad)
        assert "s-2" not in builder.assembler.known and bad.acks == 0
    finally:
        await shut(builder, stop, bus)


async def test_a_group_split_over_messages_completes_with_its_last_part(nats_server):
    bus = await Bus.connect(nats_server.url, name="builder")
    builder, stop = await recovered(bus, batch_size=1, group_size=4)
    try:
        parts = [CountingMsg(), CountingMsg()]
        members = [traj("s-0", i, group_size=4) for i in range(4)]
        await builder.handle_group(trajectory_groups.of(members[:2]), parts[0])
        assert builder.batches_published == 0
        await builder.handle_group(trajectory_groups.of(members[2:]), parts[1])
        assert builder.batches_published == 1 and [m.acks for m in parts] == [1, 1]
    finally:
        await shut(builder, stop, bus)


async def test_a_bundle_of_groups_is_acked_once_when_its_last_group_is_batched(nats_server):
    """The reward service's bundle: each group goes its own way (here: one batched now, one in the next batch);
    the message is acked once, after both, so a crash in between redelivers the group not yet batched."""
    bus = await Bus.connect(nats_server.url, name="builder")
    builder, stop = await recovered(bus, batch_size=2)
    try:
        bundle = CountingMsg()
        await builder.handle_group(trajectory_groups.of([traj("s-0", 0), traj("s-0", 1)]), CountingMsg())
        await builder.handle_message([trajectory_groups.of([traj(f"s-{n}", k) for k in range(2)]) for n in (1, 2)],
                                     bundle)
        assert builder.batches_published == 1 and bundle.acks == 0, "s-2 still waits for its batch"
        await builder.handle_group(trajectory_groups.of([traj("s-3", 0), traj("s-3", 1)]), CountingMsg())
        assert builder.batches_published == 2 and bundle.acks == 1
        again = CountingMsg()
        await builder.handle_message([trajectory_groups.of([traj(f"s-{n}", k) for k in range(2)]) for n in (1, 2)],
                                     again)
        assert again.acks == 1 and builder.received == 8, "a redelivered bundle of batched groups: acked, not counted"

        bad = CountingMsg()
        with pytest.raises(InvalidMessage, match="reward"):
            await builder.handle_message([trajectory_groups.of([traj("s-4", 0), traj("s-4", 1)]),
                                          trajectory_groups.of([traj("s-5", 0), traj("s-5", 1, reward=math.inf)])], bad)
        assert not {"s-4", "s-5"} & set(builder.assembler.known) and bad.acks == 0, "none of a bad bundle is held"
    finally:
        await shut(builder, stop, bus)
