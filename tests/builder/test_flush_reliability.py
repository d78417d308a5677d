"""The builder against the failures its flush and issue paths meet (real nats-server, faults injected at the
builder's own calls): batches the stream lost, a batch publish or ledger write that fails once, a group's
trajectories arriving before the issue's PubAck, rewards no batch may carry."""

from __future__ import annotations

import asyncio
import math

import pytest

from services.builder.config import BuilderConfig
from services.builder.grouping import check_rewards
from services.builder.ledger import Dropped
from services.builder.server import Builder
from services.common.batches import STREAM, batch_subject, publish_batch, published_batches, read_batch
from services.common.bus import SUBJECT_PROMPTS, Bus, InvalidMessage
from services.common.contracts import data_pb2
from tests.builder.test_restart import make_builder


class FakeMsg:
    """The ack handle of a fetched message."""

    def __init__(self) -> None:
        self.acked = False

    async def ack(self) -> None:
        self.acked = True

    async def in_progress(self) -> None:
        pass


def traj(gid: str, i: int, *, version: int = 0, reward: float | None = None, source: str = "gateway",
         group_size: int = 2) -> data_pb2.Trajectory:
    return data_pb2.Trajectory(trajectory_id=f"{gid}-{i}", group_id=gid, group_size=group_size, completion_ids=[5],
                               versions=[version], behavior_logprobs=[-1.0], loss_mask=[1],
                               reward=float(i) if reward is None else reward, scored=True, source=source,
                               split="train")


async def recovered(bus: Bus, **overrides) -> tuple[Builder, asyncio.Event]:
    builder = make_builder(bus, **{"total_steps": 0, **overrides})
    stop = asyncio.Event()
    await asyncio.wait_for(builder.recover(stop), timeout=30)
    return builder, stop


async def shut(builder: Builder, stop: asyncio.Event, bus: Bus) -> None:
    stop.set()
    await asyncio.gather(builder._follower, return_exceptions=True)
    await bus.close()


async def feed(builder: Builder, gid: str, version: int = 0, **kw) -> None:
    for i in range(2):
        await builder.handle_scored(traj(gid, i, version=version, **kw), FakeMsg())


async def delete_batches(bus: Bus, *indices: int) -> None:
    for index in indices:
        raw = await bus.js.get_last_msg(STREAM, batch_subject(index))
        await bus.js.delete_msg(STREAM, raw.seq)


# F2 ------------------------------------------------------------------------------------------------------------
async def test_recovery_continues_after_the_stream_lost_its_oldest_batches(nats_server):
    """Batches published without ledger records (as before the ledger kept them): the next index is the
    highest one left + 1, whatever the stream lost below it."""
    bus = await Bus.connect(nats_server.url, name="builder")
    for index in range(5):
        await publish_batch(bus, data_pb2.TrainingBatch(batch_id=f"batch-{index}", index=index,
                                                        group_ids=[f"g-{2 * index}", f"g-{2 * index + 1}"]))
    await delete_batches(bus, 0, 1)
    assert [b.index for b in await published_batches(bus)] == [2, 3, 4]
    builder, stop = await recovered(bus)
    try:
        assert builder.batches_published == 5
        assert {"g-4", "g-9"} <= builder.consumed_groups
    finally:
        await shut(builder, stop, bus)


async def test_a_restarted_builder_remembers_batches_the_stream_lost(nats_server):
    """The ledger records each batch the builder published: groups and counts survive the stream's limits."""
    bus1 = await Bus.connect(nats_server.url, name="builder-1")
    first, stop1 = await recovered(bus1, max_staleness=10)
    for g in range(10):
        await feed(first, f"o-{g}", version=g // 2)
    assert first.batches_published == 5
    await shut(first, stop1, bus1)

    bus2 = await Bus.connect(nats_server.url, name="builder-2")
    await delete_batches(bus2, 0, 1, 2, 3, 4)  # even the newest: the ledger alone knows
    second, stop2 = await recovered(bus2, max_staleness=10)
    try:
        assert second.batches_published == 5
        assert {f"o-{g}" for g in range(10)} <= second.consumed_groups
        assert second.received == 20 and second.budget.accepted == 10
    finally:
        await shut(second, stop2, bus2)


# F6 ------------------------------------------------------------------------------------------------------------
def fail_once(monkeypatch, target, name: str, error: BaseException) -> list[int]:
    """`target.name` raises `error` on its first call, then behaves as before; returns the call log."""
    real = getattr(target, name)
    calls: list[int] = []

    async def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return await real(*args, **kwargs)

    monkeypatch.setattr(target, name, flaky)
    return calls


async def test_a_failed_batch_publish_puts_its_groups_back(nats_server, monkeypatch):
    import services.builder.server as server

    bus = await Bus.connect(nats_server.url, name="builder")
    builder, stop = await recovered(bus)
    try:
        calls = fail_once(monkeypatch, server, "publish_batch", TimeoutError("nats away"))
        await feed(builder, "o-0")
        last = traj("o-1", 1)
        await builder.handle_scored(traj("o-1", 0), FakeMsg())
        with pytest.raises(TimeoutError):
            await builder.handle_scored(last, FakeMsg())
        assert [g.group_id for g in builder.assembler.ready] == ["o-0", "o-1"]
        assert builder.batches_published == 0 and await read_batch(bus, 0) is None
        # the failed message is nak'ed and comes back: its redelivery retries the flush
        await builder.handle_scored(last, FakeMsg())
        assert len(calls) == 2 and builder.batches_published == 1
        assert sorted((await read_batch(bus, 0)).group_ids) == ["o-0", "o-1"]
        assert not builder.assembler.ready and not builder.assembler.known
    finally:
        await shut(builder, stop, bus)


async def test_a_failed_stale_drop_puts_its_groups_back(nats_server, monkeypatch):
    bus = await Bus.connect(nats_server.url, name="builder")
    builder, stop = await recovered(bus, max_staleness=0)
    try:
        await feed(builder, "o-0")
        await feed(builder, "o-1")  # batch 0
        await feed(builder, "stale", version=0)  # stale at batch 1 (eta 0)
        calls = fail_once(monkeypatch, builder.ledger, "add_dropped", TimeoutError("nats away"))
        await builder.handle_scored(traj("o-2", 0, version=1), FakeMsg())
        last = traj("o-2", 1, version=1)
        with pytest.raises(TimeoutError):
            await builder.handle_scored(last, FakeMsg())
        assert [g.group_id for g in builder.assembler.ready] == ["stale", "o-2"]
        await feed(builder, "o-3", version=1)
        assert len(calls) == 2 and builder.batches_published == 2
        assert sorted((await read_batch(bus, 1)).group_ids) == ["o-2", "o-3"]
        assert "stale" in builder.consumed_groups and builder.groups_dropped == 1
    finally:
        await shut(builder, stop, bus)


# F14 -----------------------------------------------------------------------------------------------------------
async def test_trajectories_arriving_before_the_issue_publish_returns_are_accepted(nats_server, monkeypatch):
    """Rollout and reward answer the work before the builder has its PubAck (a lost PubAck, a retry)."""
    bus = await Bus.connect(nats_server.url, name="builder")
    builder, stop = await recovered(bus)
    real_publish = bus.publish
    errors: list[BaseException] = []
    acks: list[FakeMsg] = []

    async def publish_then_answer(subject, message, msg_id, **kwargs):
        stored = await real_publish(subject, message, msg_id, **kwargs)
        if subject == SUBJECT_PROMPTS:  # the answer overtakes the PubAck
            for i in range(message.group_size):
                acks.append(FakeMsg())
                try:
                    await builder.handle_scored(traj(message.group_id, i, source="workflow",
                                                     group_size=message.group_size), acks[-1])
                except InvalidMessage as exc:
                    errors.append(exc)
        return stored

    monkeypatch.setattr(bus, "publish", publish_then_answer)
    try:
        assert await builder.issue_once()  # version 0, eta 1: (0 + 1 + 1) * 2 groups, counted as one chunk
        assert not await builder.issue_once()
        assert not errors, errors
        assert builder.issued == 4 and builder.batches_published == 2 and all(a.acked for a in acks)
        assert builder.budget.in_flight == 0 and builder.budget.accepted == 4
        assert (await builder.ledger.load()).issued == 4
    finally:
        await shut(builder, stop, bus)


async def test_a_restarted_builder_republishes_the_last_work_it_counted(nats_server):
    """Counted (in the ledger) before it is published: a builder that died in between publishes it again."""
    bus = await Bus.connect(nats_server.url, name="builder")
    first, stop1 = await recovered(bus)
    first.issued = 3
    await first.ledger.set_issued(3, 0)  # g-2 counted, then the process died before its publish
    await shut(first, stop1, bus)
    bus2 = await Bus.connect(nats_server.url, name="builder-2")
    second, stop2 = await recovered(bus2)
    try:
        assert [w.group_id for w in await prompt_work(bus2)] == ["g-2"] and second.issued == 3
        assert await second.issue_once()
        assert [w.group_id for w in await prompt_work(bus2)] == ["g-2", "g-3"]
    finally:
        await shut(second, stop2, bus2)


async def test_a_restarted_builder_republishes_the_whole_last_chunk_but_what_was_consumed(nats_server):
    """A chunk is counted with one write before its works go out together: a builder that died during the burst
    publishes the chunk's works again (JetStream drops those it had stored), except a group already dropped."""
    bus = await Bus.connect(nats_server.url, name="builder")
    first, stop1 = await recovered(bus)
    await first.ledger.set_issued(4, 0, chunk_start=1)  # g-1..g-3 counted together
    await first.ledger.add_dropped(Dropped("g-2", "timeout", "workflow", 0))
    await shut(first, stop1, bus)
    bus2 = await Bus.connect(nats_server.url, name="builder-2")
    second, stop2 = await recovered(bus2)
    try:
        assert [w.group_id for w in await prompt_work(bus2)] == ["g-1", "g-3"] and second.issued == 4
    finally:
        await shut(second, stop2, bus2)


async def prompt_work(bus: Bus) -> list[data_pb2.PromptWork]:
    """The prompt work queued (no rollout runs here to take it)."""
    info = await bus.js.stream_info("PROMPTS")
    return [data_pb2.PromptWork.FromString((await bus.js.get_msg("PROMPTS", seq)).data)
            for seq in range(info.state.first_seq, info.state.last_seq + 1)] if info.state.messages else []


# F7 ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reward", [math.inf, -math.inf, math.nan, 2e6])
async def test_a_reward_no_batch_may_carry_is_an_invalid_message(nats_server, reward):
    """An agent's reward beyond max_abs_reward (default 1e6), or not finite, is dead-lettered, never batched."""
    bus = await Bus.connect(nats_server.url, name="builder")
    builder, stop = await recovered(bus)
    try:
        await builder.handle_scored(traj("o-0", 0), FakeMsg())
        with pytest.raises(InvalidMessage, match="^reward: "):
            await builder.handle_scored(traj("o-0", 1, reward=reward), FakeMsg())
        await feed(builder, "o-1")
        assert builder.batches_published == 0 and builder.received == 2
    finally:
        await shut(builder, stop, bus)


def test_reward_range_covers_step_rewards_and_is_configured():
    bad = traj("o-0", 0, reward=1.0)
    bad.step_rewards.add(end=1, reward=5.0)
    check_rewards(bad, 10.0)
    with pytest.raises(ValueError, match=r"^step_rewards\[0\]\.reward: "):
        check_rewards(bad, 2.0)
    for value in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="^max_abs_reward: "):
            BuilderConfig(max_abs_reward=value)
