"""A group's trajectories as one message on traj.raw / traj.scored: split only over max_payload, deduplicated by
its members, read back by the consumers (a bare Trajectory as a group of one), dead letters that name their group."""

from __future__ import annotations

import asyncio

import pytest

from services.common import trajectory_groups
from services.common.bus import SUBJECT_TRAJ_RAW, TYPE_HEADER, Bus, InvalidMessage, consume
from services.common.contracts import data_pb2


def member(k: int, group: str = "g-0", n: int = 4, tokens: int = 8) -> data_pb2.Trajectory:
    return data_pb2.Trajectory(trajectory_id=f"{group}-{k}", group_id=group, group_size=n, split="train",
                               completion_ids=list(range(tokens)), versions=[0] * tokens,
                               behavior_logprobs=[-1.0] * tokens, loss_mask=[1] * tokens)


class Raw:
    def __init__(self, message, type_name: str | None = None) -> None:
        self.data = message.SerializeToString()
        self.headers = {TYPE_HEADER: type_name or message.DESCRIPTOR.full_name}


def test_a_group_is_one_message_until_it_would_pass_the_limit():
    members = [member(k, tokens=500) for k in range(8)]
    (whole,) = trajectory_groups.parts(members, 1 << 20)
    assert [t.trajectory_id for t in whole.trajectories] == [t.trajectory_id for t in members]
    limit = 3 * (members[0].ByteSize() + 16) + 64  # three members and their framing
    split = trajectory_groups.parts(members, limit)
    assert len(split) == 3 and all(p.ByteSize() <= limit for p in split)
    assert [t.trajectory_id for p in split for t in p.trajectories] == [t.trajectory_id for t in members]
    ids = [trajectory_groups.message_id(p) for p in split]
    assert len(set(ids)) == 3 and all(i.startswith("g-0/") for i in ids)
    # the same members in any order are the same message; other members another one
    assert trajectory_groups.message_id(trajectory_groups.of(members[::-1])) == trajectory_groups.message_id(whole)
    assert trajectory_groups.message_id(trajectory_groups.of(members[:7])) != trajectory_groups.message_id(whole)


def test_consumers_read_groups_and_bare_trajectories():
    group = trajectory_groups.of([member(0), member(1)])
    assert len(trajectory_groups.decode(Raw(group)).trajectories) == 2
    (alone,) = trajectory_groups.decode(Raw(member(3))).trajectories
    assert alone.trajectory_id == "g-0-3"
    with pytest.raises(InvalidMessage, match="wrong message type"):
        trajectory_groups.decode(Raw(group, "meshrl.v1.PromptWork"))


@pytest.mark.parametrize("members,field", [
    ([member(0), member(1, group="g-1")], r"trajectories\[1\].group_id"),
    ([member(0), member(0)], r"trajectories\[1\].trajectory_id"),
    ([member(0), data_pb2.Trajectory(trajectory_id="e", group_id="g-0", split="eval")], r"trajectories\[1\].split"),
    ([], "trajectories"),
])
def test_a_malformed_group_is_refused_naming_the_field(members, field):
    message = data_pb2.TrajectoryGroup(group_id="g-0", trajectories=members)
    with pytest.raises(InvalidMessage, match=field):
        trajectory_groups.decode(Raw(message))


def test_a_dead_letter_names_its_group_by_type():
    group = trajectory_groups.of([member(0), member(1)])
    letter = data_pb2.DeadLetter(subject="traj.raw", consumer="reward", data=group.SerializeToString(),
                                 type=trajectory_groups.GROUP_TYPE)
    assert [t.trajectory_id for t in trajectory_groups.dead_letter_items(letter)] == ["g-0-0", "g-0-1"]
    legacy = data_pb2.DeadLetter(subject="traj.raw", consumer="reward", data=member(2).SerializeToString())
    assert [t.group_id for t in trajectory_groups.dead_letter_items(legacy)] == ["g-0"]
    work = data_pb2.PromptWork(work_id="w", group_id="g-9")
    assert trajectory_groups.dead_letter_items(data_pb2.DeadLetter(subject="prompts.work", data=work.SerializeToString())
                                               )[0].group_id == "g-9"
    assert trajectory_groups.dead_letter_items(data_pb2.DeadLetter(subject="traj.raw", data=b"\xff\xff",
                                                                   type=trajectory_groups.GROUP_TYPE)) == []


def test_on_a_real_server_a_group_is_one_message_and_its_republish_a_duplicate(nats_server):
    async def main():
        bus = await Bus.connect(nats_server.url, name="t")
        try:
            members = [member(k) for k in range(4)]
            assert await trajectory_groups.publish(bus, SUBJECT_TRAJ_RAW, members) == 1
            assert await trajectory_groups.publish(bus, SUBJECT_TRAJ_RAW, members[::-1]) == 0  # a redelivered work's
            assert (await bus.js.stream_info("TRAJ")).state.messages == 1
            # one delivery, one dead letter for the whole group when a member can never be scored
            got, stop = [], asyncio.Event()

            async def handle(group: data_pb2.TrajectoryGroup) -> None:
                got.append([t.trajectory_id for t in group.trajectories])
                stop.set()
                raise InvalidMessage("trajectory 'g-0-2': completion_ids: cannot be decoded")

            task = asyncio.create_task(consume(bus, "reward", trajectory_groups.decode, handle, stop))
            await asyncio.wait_for(stop.wait(), 20)
            await task
            assert got == [["g-0-0", "g-0-1", "g-0-2", "g-0-3"]]
            for _ in range(50):
                if (await bus.dead_letter_counts()).get("reward"):
                    break
                await asyncio.sleep(0.1)
            assert await bus.dead_letter_counts() == {"reward": 1}
        finally:
            await bus.close()

    asyncio.run(main())


def test_a_bundle_is_read_as_its_groups_and_a_malformed_one_is_refused_naming_the_field():
    a, b = trajectory_groups.of([member(0), member(1)]), trajectory_groups.of([member(0, "g-1")])
    groups = trajectory_groups.decode_groups(Raw(data_pb2.TrajectoryBundle(groups=[a, b])))
    assert [g.group_id for g in groups] == ["g-0", "g-1"]
    assert [g.group_id for g in trajectory_groups.decode_groups(Raw(a))] == ["g-0"]       # a group: itself
    assert [g.group_id for g in trajectory_groups.decode_groups(Raw(member(2)))] == ["g-0"]  # a bare trajectory
    with pytest.raises(InvalidMessage, match=r"groups\[1\].group_id"):
        trajectory_groups.decode_groups(Raw(data_pb2.TrajectoryBundle(groups=[a, a])))
    with pytest.raises(InvalidMessage, match=r"trajectories\[1\].group_id"):
        trajectory_groups.decode_groups(Raw(data_pb2.TrajectoryBundle(groups=[
            data_pb2.TrajectoryGroup(group_id="g-0", trajectories=[member(0), member(1, "g-1")])])))
    with pytest.raises(InvalidMessage, match="groups"):
        trajectory_groups.decode_groups(Raw(data_pb2.TrajectoryBundle()))
    with pytest.raises(InvalidMessage, match="undecodable"):
        trajectory_groups.decode_groups(type("M", (), {"data": b"\xff\xff", "headers": {
            TYPE_HEADER: trajectory_groups.BUNDLE_TYPE}})())
    letter = data_pb2.DeadLetter(subject="traj.raw", consumer="reward", type=trajectory_groups.BUNDLE_TYPE,
                                 data=data_pb2.TrajectoryBundle(groups=[a, b]).SerializeToString())
    assert [t.group_id for t in trajectory_groups.dead_letter_items(letter)] == ["g-0", "g-0", "g-1"]


def test_on_a_real_server_groups_published_together_are_one_bundle_up_to_the_limit(nats_server):
    async def main():
        bus = await Bus.connect(nats_server.url, name="t")
        try:
            groups = [[member(k, f"g-{n}") for k in range(4)] for n in range(5)]
            assert await trajectory_groups.publish_together(bus, SUBJECT_TRAJ_RAW, groups) == 1
            assert await trajectory_groups.publish_together(bus, SUBJECT_TRAJ_RAW, groups[::-1]) == 0, \
                "the same members again: a duplicate"
            msg = await bus.js.get_msg("TRAJ", 1)
            assert msg.headers[TYPE_HEADER] == trajectory_groups.BUNDLE_TYPE
            bundle = data_pb2.TrajectoryBundle.FromString(msg.data)
            assert [g.group_id for g in bundle.groups] == [f"g-{n}" for n in range(5)]
            # a group alone goes as its TrajectoryGroup; over the limit, the groups are spread over bundles
            assert await trajectory_groups.publish_together(bus, SUBJECT_TRAJ_RAW, [[member(0, "g-9")]]) == 1
            assert (await bus.js.get_msg("TRAJ", 2)).headers[TYPE_HEADER] == trajectory_groups.GROUP_TYPE
        finally:
            await bus.close()

    asyncio.run(main())


def test_groups_are_packed_whole_in_order_and_one_over_the_limit_goes_alone():
    groups = [trajectory_groups.of([member(k, f"g-{n}", tokens=100) for k in range(4)]) for n in range(5)]
    one = groups[0].ByteSize() + 8
    packed = trajectory_groups.pack(groups, 2 * one)
    assert [[g.group_id for g in each] for each in packed] == [["g-0", "g-1"], ["g-2", "g-3"], ["g-4"]]
    huge = trajectory_groups.of([member(k, "big", tokens=2000) for k in range(4)])
    packed = trajectory_groups.pack([groups[0], huge, groups[1]], 2 * one)
    assert [[g.group_id for g in each] for each in packed] == [["g-0"], ["big"], ["g-1"]]
