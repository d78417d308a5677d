"""Admission control: accepted + in_flight <= (version + eta + 1) * batch_size under any interleaving."""

from __future__ import annotations

import collections
import random

import pytest

from services.builder.admission import StalenessBudget
from services.builder.grouping import Group, assemble_batch
from services.common.contracts import data_pb2


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_bound_holds_under_random_interleavings(eta: int, seed: int):
    rng = random.Random(seed)
    budget = StalenessBudget(batch_size=4, max_staleness=eta)
    for _ in range(3000):
        op = rng.choice(["issue", "issue", "complete", "drop", "version", "unaccept"])
        if op == "issue":
            before = budget.capacity()
            assert budget.try_issue() == (before > 0)
        elif op in ("complete", "drop") and budget.in_flight:
            budget.on_complete(accepted=op == "complete")
        elif op == "version" and budget.accepted >= (budget.version + 1) * budget.batch_size:
            budget.on_version(budget.version + 1)  # the trainer only advances after a full batch
        elif op == "unaccept" and budget.accepted:
            budget.on_unaccept()
        assert budget.accepted + budget.in_flight <= (budget.version + eta + 1) * budget.batch_size
        assert budget.capacity() >= 0


def test_eta_zero_is_synchronous():
    budget = StalenessBudget(batch_size=3, max_staleness=0)
    assert [budget.try_issue() for _ in range(4)] == [True, True, True, False]
    for _ in range(3):
        budget.on_complete(accepted=True)
    assert not budget.try_issue(), "the next batch waits for the new version"
    budget.on_version(1)
    assert budget.try_issue()


def test_dropped_group_releases_its_slot():
    budget = StalenessBudget(batch_size=1, max_staleness=0)
    assert budget.try_issue() and not budget.try_issue()
    budget.on_complete(accepted=False)
    assert budget.dropped == 1 and budget.try_issue()


def test_versions_never_go_backwards():
    budget = StalenessBudget(batch_size=2, max_staleness=1)
    budget.on_version(5)
    budget.on_version(3)
    assert budget.version == 5


@pytest.mark.parametrize("field,kwargs", [("batch_size", {"batch_size": 0, "max_staleness": 1}),
                                          ("max_staleness", {"batch_size": 2, "max_staleness": -1})])
def test_bad_settings_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        StalenessBudget(**kwargs)


def _group(gid: str, versions: list[int], size: int = 1) -> Group:
    g = Group(gid, size)
    g.members[gid] = data_pb2.Trajectory(trajectory_id=gid, group_id=gid, group_size=size, versions=versions)
    return g


@pytest.mark.parametrize("seed", range(10))
def test_simulated_pipeline_never_trains_beyond_eta(seed: int):
    """Issue under the budget, generate at random (interrupted) versions, batch: every batch obeys eta."""
    rng = random.Random(seed)
    eta, bsz = rng.choice([0, 1, 2]), 3
    budget = StalenessBudget(batch_size=bsz, max_staleness=eta)
    ready: collections.deque[Group] = collections.deque()
    in_flight: list[int] = []  # issue version of each running group
    trainer_version = 0
    index = 0
    for step in range(2000):
        if budget.try_issue():
            in_flight.append(trainer_version)
        if in_flight and rng.random() < 0.5:
            issued = in_flight.pop(rng.randrange(len(in_flight)))
            start = rng.randint(max(0, issued - 1), trainer_version)  # weights may lag the trainer by one
            versions = sorted(rng.randint(start, trainer_version) for _ in range(4))
            ready.append(_group(f"g{step}", versions))
            budget.on_complete(accepted=True)
        result = assemble_batch(ready, batch_size=bsz, index=index, max_staleness=eta, batch_id=f"b{index}",
                                created_at=0.0)
        for _ in result.stale:
            budget.on_unaccept()
        if result.batch is not None:
            for traj in result.batch.trajectories:
                assert index - min(traj.versions) <= eta
            index += 1
            trainer_version = index
            budget.on_version(trainer_version)
    assert index > 10, "the pipeline made progress"


def test_a_slot_whose_prompt_was_not_published_is_given_back():
    b = StalenessBudget(batch_size=2, max_staleness=0)
    assert b.try_issue() and b.try_issue() and not b.try_issue()
    b.cancel_issue(refilled=False)               # the publish failed: the slot is free again
    assert (b.in_flight, b.capacity()) == (1, 1) and b.try_issue()
    b.on_complete(accepted=True)
    b.on_filtered()                              # its slot goes to an extra prompt (a refill)
    assert b.try_issue() and b.refills == 1
    b.cancel_issue(refilled=True)                # that refill was not published either
    assert (b.refills, b.in_flight, b.capacity()) == (0, 1, 1)
