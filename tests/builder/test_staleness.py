"""The one staleness formula, and both services agreeing on it."""

from services.builder.grouping import Group
from services.common.contracts import data_pb2
from services.common.staleness import oldest_version, staleness
from services.trainer.batching import trajectory_staleness


def test_staleness_counts_from_the_oldest_generated_token():
    assert oldest_version([-1, 4, 3, -1]) == 3 and staleness([-1, 4, 3, -1], 5) == 2
    assert oldest_version([-1, -1]) is None and staleness([-1, -1], 5) == 0 and staleness([], 5) == 0


def test_builder_group_and_trainer_trajectory_agree():
    a = data_pb2.Trajectory(trajectory_id="a", group_id="g", versions=[-1, 4, 6])
    b = data_pb2.Trajectory(trajectory_id="b", group_id="g", versions=[5, 5])
    group = Group("g", 2, {"a": a, "b": b})
    assert group.staleness(7) == max(trajectory_staleness(t, 7) for t in (a, b)) == 3
