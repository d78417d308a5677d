"""Grouping trajectories and assembling batches with the staleness filter."""

from __future__ import annotations

import collections

import pytest

from services.builder.evaluation import EvalTracker
from services.builder.grouping import Group, GroupAssembler, assemble_batch
from services.common.contracts import data_pb2


def traj(tid: str, gid: str, size: int, versions=(0,)) -> data_pb2.Trajectory:
    return data_pb2.Trajectory(trajectory_id=tid, group_id=gid, group_size=size, versions=list(versions),
                               completion_ids=[1] * len(versions))


def test_group_completes_with_distinct_members_and_ignores_duplicates():
    asm = GroupAssembler()
    assert asm.add(traj("a0", "a", 3)) is None
    assert asm.add(traj("a0", "a", 3)) is None  # redelivery
    assert asm.add(traj("a1", "a", 3)) is None
    group = asm.add(traj("a2", "a", 3))
    assert group is not None and sorted(group.members) == ["a0", "a1", "a2"]
    assert asm.duplicates == 1 and list(asm.ready) == [group] and "a" not in asm.open


def test_bad_group_size_names_the_field():
    with pytest.raises(ValueError, match="group_size"):
        GroupAssembler().add(traj("x", "x", 0))


def _ready(*groups: tuple[str, list[int]]) -> collections.deque[Group]:
    out = collections.deque()
    for gid, versions in groups:
        g = Group(gid, 1)
        g.members[gid] = traj(gid, gid, 1, versions)
        out.append(g)
    return out


def test_batch_takes_fresh_groups_and_drops_stale_ones():
    ready = _ready(("old", [1, 2]), ("a", [3]), ("b", [2, 4]), ("c", [4]))
    result = assemble_batch(ready, batch_size=2, index=4, max_staleness=2, batch_id="b4", created_at=1.0)
    assert [g.group_id for g in result.stale] == ["old"]  # 4 - 1 = 3 > eta
    assert [t.trajectory_id for t in result.batch.trajectories] == ["a", "b"]
    assert result.batch.index == 4 and result.batch.dropped_stale == 1
    assert [g.group_id for g in ready] == ["c"]


def test_not_enough_fresh_groups_keeps_them_in_order():
    ready = _ready(("a", [5]), ("b", [5]))
    result = assemble_batch(ready, batch_size=3, index=5, max_staleness=0, batch_id="b5", created_at=1.0)
    assert result.batch is None and result.stale == []
    assert [g.group_id for g in ready] == ["a", "b"]


def test_group_without_generated_tokens_is_never_stale():
    g = Group("g", 1)
    g.members["g"] = traj("g", "g", 1, versions=[-1, -1])
    assert g.staleness(100) == 0


def test_eval_rounds_attribute_results_and_complete_once():
    tracker = EvalTracker(every=5)
    assert tracker.due(0) and not tracker.due(3)
    rnd = tracker.start(0, expected=2)
    assert not tracker.due(0)
    assert tracker.record(rnd.round_id, "t1", 1.0, [0, 0]) is None
    assert tracker.record(rnd.round_id, "t1", 0.0, [0]) is None  # duplicate ignored
    done = tracker.record(rnd.round_id, "t2", 0.0, [0, 1])
    assert done is rnd and rnd.accuracy == 0.5 and rnd.token_versions == {0, 1}
    assert not tracker.pending


def test_a_redelivered_member_of_a_complete_group_never_reopens_it():
    asm = GroupAssembler()
    asm.add(traj("a0", "a", 2), ack="d1")
    group = asm.add(traj("a1", "a", 2), ack="d2")
    assert group is not None and list(asm.ready) == [group]
    # the same member again (its ack deadline passed while the group waited for a batch)
    assert asm.add(traj("a1", "a", 2), ack="d3") is None
    assert "a" not in asm.open and list(asm.ready) == [group] and group.acks == ["d1", "d2", "d3"]
    assert asm.held() == ["d1", "d2", "d3"]
    assert asm.forget("a") is group and not asm.ready and asm.held() == []
