"""DAPO dynamic sampling in the builder: groups of equal rewards are filtered and refilled, so every batch
keeps batch_size informative groups, within the staleness budget, across a restart."""

from __future__ import annotations

import asyncio
import collections
import random

import pytest

from services.builder.admission import StalenessBudget
from services.builder.grouping import Group, assemble_batch, reward_varies
from services.common.batches import published_batches
from services.common.bus import SUBJECT_TRAJ_SCORED, Bus, consume, decoder
from services.common.contracts import data_pb2
from tests.builder.test_restart import ACK_WAIT, crash, make_builder, trained, until


def _group(gid: str, rewards: list[float], version: int = 0) -> Group:
    g = Group(gid, len(rewards))
    for i, r in enumerate(rewards):
        g.members[f"{gid}-{i}"] = data_pb2.Trajectory(trajectory_id=f"{gid}-{i}", group_id=gid,
                                                       group_size=len(rewards), versions=[version], reward=r)
    return g


def test_reward_varies_needs_two_distinct_rewards():
    assert reward_varies(_group("a", [0.0, 1.0, 1.0]))
    assert not reward_varies(_group("b", [1.0, 1.0])) and not reward_varies(_group("c", [0.5]))


@pytest.mark.parametrize("seed", range(5))
def test_filtered_groups_are_refilled_within_the_budget(seed: int):
    """Issue under the budget, filter equal-reward groups at completion, batch: every batch is full of
    informative groups, the budget bound holds, and each filtered group's slot went to one extra prompt."""
    rng = random.Random(seed)
    eta, bsz = rng.choice([0, 1, 2]), 4
    budget = StalenessBudget(batch_size=bsz, max_staleness=eta)
    ready: collections.deque[Group] = collections.deque()
    in_flight, issued, index, filtered_seen = 0, 0, 0, 0
    for step in range(3000):
        if budget.try_issue():
            in_flight += 1
            issued += 1
        if in_flight and rng.random() < 0.5:
            in_flight -= 1
            group = _group(f"g{step}", [float(rng.random() < 0.3) for _ in range(4)], version=index)
            budget.on_complete(accepted=True)
            if reward_varies(group):
                ready.append(group)
            else:
                budget.on_filtered()
                filtered_seen += 1
        assert budget.accepted + budget.in_flight <= budget.limit
        result = assemble_batch(ready, batch_size=bsz, index=index, max_staleness=eta, batch_id=f"b{index}",
                                created_at=0.0)
        if result.batch is not None:
            assert len(result.groups) == bsz and all(reward_varies(g) for g in result.groups)
            index += 1
            budget.on_version(index)
    assert index > 10 and filtered_seen == budget.filtered > 0
    assert issued == budget.accepted + budget.in_flight + budget.filtered  # every prompt is accounted for
    while budget.refills < budget.filtered:  # a refill waits only for budget capacity
        assert budget.try_issue()
    assert budget.refills == budget.filtered


class VaryingRollout:
    """Answers prompt work: groups g-<n> with n % 3 == 0 score all 1.0 (no signal), the others 0.0 and 1.0."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def handle(self, work: data_pb2.PromptWork) -> None:
        n = int(work.group_id.removeprefix("g-")) if work.group_id.startswith("g-") else 1
        for i in range(work.group_size):
            traj = data_pb2.Trajectory(
                trajectory_id=f"{work.work_id}-{i}", group_id=work.group_id, task_id=work.task_id,
                work_id=work.work_id, group_size=work.group_size, completion_ids=[5], versions=[work.issued_version],
                behavior_logprobs=[-1.0], loss_mask=[1], reward=1.0 if n % 3 == 0 else float(i % 2), scored=True,
                source="workflow", split=work.split, grading=work.grading)
            await self.bus.publish(SUBJECT_TRAJ_SCORED, traj, traj.trajectory_id)


async def test_builder_keeps_batches_full_and_recovers_its_counts(nats_server):
    rollout_bus = await Bus.connect(nats_server.url, name="rollout", ack_wait=ACK_WAIT)
    stop = asyncio.Event()
    rollout_task = asyncio.create_task(consume(rollout_bus, "rollout", decoder(data_pb2.PromptWork),
                                               VaryingRollout(rollout_bus).handle, stop, concurrency=8))
    bus1 = await Bus.connect(nats_server.url, name="builder-1", ack_wait=ACK_WAIT)
    first = make_builder(bus1, dynamic_sampling=True)
    tasks = first.start(stop)
    try:
        # version 0 admits 4 groups; g-0 and g-3 have no signal, so g-4 and g-5 are issued in their place
        await until(lambda: first.batches_published == 2, "batches 0 and 1")
        status = first.status()
        assert status.groups_filtered == 2 and status.extra_prompts_issued == 2 and status.groups_issued == 6
        assert status.groups_dropped == 0 and status.trajectories_dropped_stale == 0
        await crash(tasks, bus1)

        bus2 = await Bus.connect(nats_server.url, name="builder-2", ack_wait=ACK_WAIT)
        second = make_builder(bus2, dynamic_sampling=True)
        tasks = second.start(stop)
        await until(lambda: second.live.is_set(), "recovery")
        assert (second.budget.filtered, second.budget.refills, second.issued) == (2, 2, 6)
        assert second.budget.in_flight == 0 and second.budget.accepted == 4
        await trained(rollout_bus, 1)
        await trained(rollout_bus, 2)
        await until(lambda: second.batches_published == 4, "batches 2 and 3")
        batches = await published_batches(bus2)
        groups = [g for b in batches for g in b.group_ids]
        assert len(groups) == len(set(groups)) == 8, "every batch keeps batch_size groups"
        assert not [g for g in groups if int(g.removeprefix("g-")) % 3 == 0], "no group without signal is batched"
    finally:
        stop.set()
        await asyncio.gather(*tasks, rollout_task, return_exceptions=True)
        await rollout_bus.close()
