"""A builder killed mid-run and started again continues where it stopped (real nats-server).

A stand-in for rollout + reward answers every prompt work with scored trajectories, so the builder's own
recovery is what is tested: the next batch index, the issued count, groups it held unacked, eval rounds,
groups already batched arriving again.
"""

from __future__ import annotations

import asyncio

from services.builder.config import BuilderConfig
from services.builder.server import Builder
from services.common.batches import published_batches, read_batch
from services.common.bus import SUBJECT_TRAJ_SCORED, SUBJECT_VERSIONS, Bus, InvalidMessage, consume, decoder
from services.common.contracts import data_pb2
from services.common.runtime import cancel_and_wait

ACK_WAIT = 2.0


def make_builder(bus: Bus, **overrides) -> Builder:
    config = BuilderConfig(**{"batch_size": 2, "group_size": 2, "max_staleness": 1, "eval_size": 3, "eval_every": 0,
                              "train_size": 50, "total_steps": 4, **overrides})
    return Builder(config, bus, lambda text: [1, 2, 3], [0])


async def until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


class FakeRollout:
    """Answers prompt work with scored trajectories; `hold` lists group ids whose last member waits."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.hold: set[str] = set()
        self.held: list[data_pb2.Trajectory] = []
        self.works: list[str] = []

    async def handle(self, work: data_pb2.PromptWork) -> None:
        self.works.append(work.work_id)
        for i in range(work.group_size):
            traj = data_pb2.Trajectory(
                trajectory_id=f"{work.work_id}-{i}", group_id=work.group_id, task_id=work.task_id,
                work_id=work.work_id, group_size=work.group_size, completion_ids=[5], versions=[work.issued_version],
                behavior_logprobs=[-1.0], loss_mask=[1], reward=1.0, scored=True, source="workflow", split=work.split,
                grading=work.grading)
            if work.group_id in self.hold and i == work.group_size - 1:
                self.held.append(traj)
                continue
            await self.bus.publish(SUBJECT_TRAJ_SCORED, traj, traj.trajectory_id)

    async def release(self) -> None:
        for traj in self.held:
            await self.bus.publish(SUBJECT_TRAJ_SCORED, traj, traj.trajectory_id)
        self.held.clear()


async def trained(bus: Bus, version: int) -> None:
    event = data_pb2.VersionEvent(event_id=f"trained-{version}", version=version, kind=data_pb2.VERSION_KIND_TRAINED)
    await bus.publish(SUBJECT_VERSIONS, event, event.event_id)
    deployed = data_pb2.VersionEvent(event_id=f"deployed-{version}", version=version,
                                     kind=data_pb2.VERSION_KIND_DEPLOYED)
    await bus.publish(SUBJECT_VERSIONS, deployed, deployed.event_id)


async def crash(builder_tasks: list[asyncio.Task], bus: Bus) -> None:
    """Die like SIGKILL: nothing acked, nothing flushed."""
    assert await cancel_and_wait(builder_tasks) == []
    await bus.nc.close()


async def test_builder_restart_loses_nothing_and_batches_nothing_twice(nats_server):
    rollout_bus = await Bus.connect(nats_server.url, name="rollout", ack_wait=ACK_WAIT)
    rollout = FakeRollout(rollout_bus)
    rollout.hold.add("g-5")  # group 5 is open (one member short, unacked) when the builder dies
    stop = asyncio.Event()
    rollout_task = asyncio.create_task(consume(rollout_bus, "rollout", decoder(data_pb2.PromptWork), rollout.handle,
                                               stop, concurrency=8))
    bus1 = await Bus.connect(nats_server.url, name="builder-1", ack_wait=ACK_WAIT)
    first = make_builder(bus1)
    tasks = first.start(stop)
    try:
        # version 0 admits (0 + 1 + 1) * 2 = 4 groups: two batches
        await until(lambda: first.batches_published == 2, "batches 0 and 1")
        await trained(rollout_bus, 1)
        await until(lambda: first.issued == 6 and len(rollout.held) == 1, "groups 4, 5 issued; 5 held open")
        issued_before = first.issued
        await crash(tasks, bus1)

        await rollout.release()  # group 5 completes while no builder runs
        bus2 = await Bus.connect(nats_server.url, name="builder-2", ack_wait=ACK_WAIT)
        second = make_builder(bus2)
        tasks = second.start(stop)
        await until(lambda: second.live.is_set(), "recovery")
        assert second.batches_published == 2 and second.issued == issued_before
        assert second.budget.version == 1 and second.deployed_version == 1
        assert second.evals.rounds[0].complete, "the first eval round finished before the crash"
        assert {"g-0", "g-1", "g-2", "g-3"} <= second.consumed_groups
        await until(lambda: second.batches_published == 3, "batch 2 from the redelivered groups 4 and 5")
        await trained(rollout_bus, 2)
        await trained(rollout_bus, 3)
        await until(lambda: second.batches_published == 4, "batch 3")

        batches = await published_batches(bus2)
        assert [b.index for b in batches] == [0, 1, 2, 3]
        groups = [g for b in batches for g in b.group_ids]
        assert len(groups) == len(set(groups)) == 8
        ids = [t for b in batches for t in b.trajectory_ids]
        assert len(ids) == len(set(ids)) == 16
        batch2 = await read_batch(bus2, 2)
        assert sorted(batch2.group_ids) == ["g-4", "g-5"]
        # no task was asked twice (ids are deterministic: a re-issue would have had the same id)
        train_works = [w for w in rollout.works if w.startswith("g-")]
        assert len(train_works) == len(set(train_works))
    finally:
        stop.set()
        await asyncio.gather(*tasks, rollout_task, return_exceptions=True)
        await rollout_bus.close()


async def test_restarted_builder_finishes_an_eval_round_it_had_issued(nats_server):
    rollout_bus = await Bus.connect(nats_server.url, name="rollout", ack_wait=ACK_WAIT)
    rollout = FakeRollout(rollout_bus)
    rollout.hold.add("eval-0-2")
    stop = asyncio.Event()
    rollout_task = asyncio.create_task(consume(rollout_bus, "rollout", decoder(data_pb2.PromptWork), rollout.handle,
                                               stop, concurrency=8))
    bus1 = await Bus.connect(nats_server.url, name="builder-1", ack_wait=ACK_WAIT)
    first = make_builder(bus1, group_size=1)
    tasks = first.start(stop)
    seen: list[data_pb2.VersionEvent] = []
    try:
        await until(lambda: len(first.evals.rounds[0].rewards) == 2 if first.evals.rounds else False, "2 of 3 results")
        # the third work may still be queued at the stand-in rollout: a release before it is held would release
        # nothing, and the re-issued work dedupes, so its result would never come
        await until(lambda: len(rollout.held) == 1, "the third result held back")
        await crash(tasks, bus1)
        await rollout.release()
        bus2 = await Bus.connect(nats_server.url, name="builder-2", ack_wait=ACK_WAIT)
        second = make_builder(bus2, group_size=1)
        tasks = second.start(stop)
        await until(lambda: second.evals.rounds.get(0) is not None and second.evals.rounds[0].complete,
                    "round 0 completed from redelivered results")
        await until(lambda: second.issued > 0, "training work after the first eval")
        sub = await bus2.js.subscribe(SUBJECT_VERSIONS, ordered_consumer=True)
        try:
            while True:
                msg = await sub.next_msg(timeout=2)
                seen.append(data_pb2.VersionEvent.FromString(msg.data))
        except Exception:  # noqa: BLE001 - no more events
            pass
        evals = [e for e in seen if e.kind == data_pb2.VERSION_KIND_EVAL]
        assert len(evals) == 1 and evals[0].metrics["n"] == 3.0
    finally:
        stop.set()
        await asyncio.gather(*tasks, rollout_task, return_exceptions=True)
        await rollout_bus.close()


async def test_scored_trajectories_the_builder_never_issued_are_dead_lettered(nats_server):
    bus = await Bus.connect(nats_server.url, name="builder", ack_wait=ACK_WAIT)
    builder = make_builder(bus)
    builder.live.set()
    stray = data_pb2.Trajectory(trajectory_id="x-0", group_id="g-999", group_size=2, source="workflow", split="train")
    bad_eval = data_pb2.Trajectory(trajectory_id="e-0", group_id="e", group_size=1, split="eval")
    try:
        for traj in (stray, bad_eval):
            try:
                await builder.handle_scored(traj, msg=None)
            except InvalidMessage as exc:
                assert "group_id" in str(exc) or "grading.eval_round: missing" in str(exc)
            else:
                raise AssertionError(f"{traj.trajectory_id} was accepted")
        assert builder.budget.in_flight == 0 and not builder.assembler.known
    finally:
        await bus.close()
