"""The chaos schedule and the run invariant's verdicts (pure)."""

from __future__ import annotations

import pytest

from launcher.audit import Audit
from launcher.chaos import TARGETS, TRAINER_RANK, chaos, schedule


def test_every_target_is_hit_once_by_default_at_versions_inside_the_run():
    plan = schedule(3, 40)
    assert sorted(k.service for k in plan) == sorted(TARGETS)
    assert all(1 <= k.at_version <= 38 for k in plan)
    assert [k.at_version for k in plan] == sorted(k.at_version for k in plan)
    assert plan == schedule(3, 40), "the seed decides"
    assert plan != schedule(4, 40)


def test_more_kills_than_services_cycle_and_unknown_services_are_refused():
    plan = schedule(0, 30, kills=8, services=("trainer", "builder"))
    assert [k.service for k in plan].count("trainer") == 4
    with pytest.raises(ValueError, match="services"):
        schedule(0, 30, services=("postgres",))
    with pytest.raises(ValueError, match="kills"):
        schedule(0, 30, kills=-1)


def test_a_trainer_rank_is_a_target_only_when_named_and_only_for_a_rank_group():
    assert TRAINER_RANK not in {k.service for k in schedule(0, 40, kills=20)}  # not in the default set
    assert {k.service for k in schedule(0, 30, kills=2, services=(TRAINER_RANK,))} == {TRAINER_RANK}
    with pytest.raises(ValueError, match=f"^services: {TRAINER_RANK} needs a trainer of 2 or more ranks"):
        chaos("configs/chaos.yaml", services=(TRAINER_RANK,), progress=False)


def audit(**overrides) -> Audit:
    values = dict(completed=True, total_steps=4, eta=1, batch_indices_trained=[0, 1, 2, 3], skipped_indices=[],
                  duplicate_trajectories_trained=0, groups_admitted=10, groups_trained=8, groups_dropped={"stale": 2},
                  dlq_messages={}, max_staleness_trained=1)
    return Audit(**{**values, **overrides})


def test_a_clean_run_passes():
    assert audit().violations() == [] and audit().groups_lost == 0


@pytest.mark.parametrize("overrides, words", [
    ({"completed": False}, "did not complete"),
    ({"batch_indices_trained": [0, 1, 1, 3]}, "lineage"),
    ({"batch_indices_trained": [0, 1, 3]}, "lineage"),
    ({"duplicate_trajectories_trained": 3}, "trained twice"),
    ({"groups_admitted": 11}, "neither trained nor dropped"),
    ({"max_staleness_trained": 2}, "max staleness"),
])
def test_each_broken_invariant_is_named(overrides, words):
    (violation,) = audit(**overrides).violations()
    assert words in violation


def test_a_skipped_index_completes_the_lineage():
    assert audit(batch_indices_trained=[0, 1, 3], skipped_indices=[2]).violations() == []
