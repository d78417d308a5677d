"""The data plane against a real nats-server: redelivery after a crash, dedupe, dead letters."""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from services.common.bus import SUBJECT_TRAJ_RAW, Bus, InvalidMessage, consume, decoder
from services.common.contracts import data_pb2
from tests.lines import read_line

ROOT = pathlib.Path(__file__).resolve().parents[2]
ACK_WAIT = 2.0

KILLED_CONSUMER = textwrap.dedent("""
    import asyncio, sys, time
    from services.common.bus import Bus
    async def main():
        bus = await Bus.connect(sys.argv[1], name="doomed", ack_wait=float(sys.argv[2]))
        sub = await bus.js.pull_subscribe_bind(durable="reward", stream="TRAJ")
        msgs = await sub.fetch(1, timeout=10)
        print(msgs[0].headers["Nats-Msg-Id"], flush=True)
        time.sleep(600)  # never acks; the test kills us
    asyncio.run(main())
""")


def traj(tid: str) -> data_pb2.Trajectory:
    return data_pb2.Trajectory(trajectory_id=tid, group_id="g", group_size=1, completion_ids=[1], versions=[0],
                               behavior_logprobs=[-1.0], loss_mask=[1])


async def collect(bus: Bus, consumer: str, n: int, handle=None, timeout: float = 20.0) -> list[data_pb2.Trajectory]:
    got: list[data_pb2.Trajectory] = []
    stop = asyncio.Event()

    async def default(t: data_pb2.Trajectory) -> None:
        if handle is not None:
            await handle(t)
        got.append(t)
        if len(got) >= n:
            stop.set()

    task = asyncio.create_task(consume(bus, consumer, decoder(data_pb2.Trajectory), default, stop))
    try:
        await asyncio.wait_for(stop.wait(), timeout)
    finally:
        stop.set()
        await task
    return got


async def settled(bus: Bus, stream: str, consumer: str, timeout: float = 5.0):
    """The consumer's info once the acks sent have been applied (an ack is not confirmed by the server), or as it
    is after `timeout`."""
    give_up = asyncio.get_running_loop().time() + timeout
    while True:
        info = await bus.js.consumer_info(stream, consumer)
        if info.num_ack_pending == 0 or asyncio.get_running_loop().time() > give_up:
            return info
        await asyncio.sleep(0.05)


async def dead_letters(bus: Bus, consumer: str, n: int) -> list[data_pb2.DeadLetter]:
    sub = await bus.js.subscribe(f"dlq.{consumer}", ordered_consumer=True)
    out = []
    for _ in range(n):
        msg = await sub.next_msg(timeout=25)
        out.append(data_pb2.DeadLetter.FromString(msg.data))
    await sub.unsubscribe()
    return out


async def test_message_of_a_killed_consumer_is_redelivered_to_another(nats_server):
    bus = await Bus.connect(nats_server.url, name="test", ack_wait=ACK_WAIT)
    try:
        await bus.publish(SUBJECT_TRAJ_RAW, traj("t-kill"), "t-kill")
        proc = subprocess.Popen([sys.executable, "-c", KILLED_CONSUMER, nats_server.url, str(ACK_WAIT)],
                                stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            assert read_line(proc, 90, "the id of the message it fetched").strip() == f"{SUBJECT_TRAJ_RAW}/t-kill"
        finally:
            proc.kill()
            proc.wait(30)
        got = await collect(bus, "reward", 1)
        assert [t.trajectory_id for t in got] == ["t-kill"]
        info = await settled(bus, "TRAJ", "reward")
        assert info.delivered.consumer_seq == 2 and info.num_ack_pending == 0  # delivered twice, acked once
    finally:
        await bus.close()


async def test_a_handler_running_past_the_ack_deadline_keeps_its_message(nats_server):
    """The consumer's keep-alive extends the deadline of a message whose handler runs long, so it is not delivered
    again to the fetches the consumer keeps making meanwhile."""
    bus = await Bus.connect(nats_server.url, name="test", ack_wait=ACK_WAIT)
    started: list[str] = []
    finished = asyncio.Event()
    try:
        await bus.publish(SUBJECT_TRAJ_RAW, traj("t-slow"), "t-slow")
        await bus.publish(SUBJECT_TRAJ_RAW, traj("t-next"), "t-next")

        async def handle(t: data_pb2.Trajectory) -> None:
            started.append(t.trajectory_id)
            if t.trajectory_id == "t-slow":
                await asyncio.sleep(ACK_WAIT * 2.5)
                finished.set()

        stop = asyncio.Event()
        task = asyncio.create_task(consume(bus, "reward", decoder(data_pb2.Trajectory), handle, stop, concurrency=2))
        try:
            await asyncio.wait_for(finished.wait(), 20)
        finally:
            stop.set()
            await task
        assert sorted(started) == ["t-next", "t-slow"]
        info = await settled(bus, "TRAJ", "reward")
        assert info.num_redelivered == 0 and info.num_ack_pending == 0
    finally:
        await bus.close()


async def test_republished_trajectory_is_deduplicated(nats_server):
    bus = await Bus.connect(nats_server.url, name="test")
    try:
        assert await bus.publish(SUBJECT_TRAJ_RAW, traj("t-dup"), "t-dup") is True
        assert await bus.publish(SUBJECT_TRAJ_RAW, traj("t-dup"), "t-dup") is False
        # the same id on another subject is a different message (a trajectory keeps its id when scored)
        assert await bus.publish("traj.scored", traj("t-dup"), "t-dup") is True
        info = await bus.js.stream_info("TRAJ")
        assert info.state.messages == 2
    finally:
        await bus.close()


async def test_poison_and_wrong_schema_messages_go_to_dead_letters_and_the_consumer_continues(nats_server):
    bus = await Bus.connect(nats_server.url, name="test")
    try:
        await bus.js.publish(SUBJECT_TRAJ_RAW, b"\xff\x00garbage", headers={"Meshrl-Type": "meshrl.v1.Trajectory"})
        await bus.js.publish(SUBJECT_TRAJ_RAW, b"no header")
        await bus.publish(SUBJECT_TRAJ_RAW, data_pb2.PromptWork(work_id="w"), "w")  # wrong schema
        await bus.publish(SUBJECT_TRAJ_RAW, traj("bad"), "bad")                    # fails validation
        await bus.publish(SUBJECT_TRAJ_RAW, traj("good"), "good")

        async def validate(t: data_pb2.Trajectory) -> None:
            if t.trajectory_id == "bad":
                raise InvalidMessage("reward: the verifier refused it")

        got = await collect(bus, "reward", 1, handle=validate)
        assert [t.trajectory_id for t in got] == ["good"]
        letters = await dead_letters(bus, "reward", 4)
        reasons = [d.reason for d in letters]
        assert "undecodable meshrl.v1.Trajectory" in reasons[0]
        assert "wrong message type" in reasons[1] and "wrong message type" in reasons[2]
        assert "meshrl.v1.PromptWork" in reasons[2]
        assert reasons[3] == "reward: the verifier refused it"
        assert all(d.consumer == "reward" and d.subject == SUBJECT_TRAJ_RAW for d in letters)
        assert letters[0].data == b"\xff\x00garbage"
    finally:
        await bus.close()


async def test_failing_handler_is_retried_then_dead_lettered(nats_server):
    bus = await Bus.connect(nats_server.url, name="test")
    attempts = []
    try:
        await bus.publish(SUBJECT_TRAJ_RAW, traj("flaky"), "flaky")
        await bus.publish(SUBJECT_TRAJ_RAW, traj("after"), "after")

        async def flaky(t: data_pb2.Trajectory) -> None:
            if t.trajectory_id == "flaky":
                attempts.append(1)
                raise RuntimeError("transient")

        stop = asyncio.Event()
        got = []

        async def handle(t: data_pb2.Trajectory) -> None:
            await flaky(t)
            got.append(t.trajectory_id)

        task = asyncio.create_task(consume(bus, "reward", decoder(data_pb2.Trajectory), handle, stop))
        try:
            (letter,) = await asyncio.wait_for(dead_letters(bus, "reward", 1), 90)
        finally:
            stop.set()
            await task
        assert got == ["after"]
        assert "failed 5 times" in letter.reason
        assert len(attempts) == 5
    finally:
        await bus.close()


@pytest.mark.parametrize("streams", [2])
async def test_creating_streams_and_consumers_is_idempotent(nats_server, streams):
    for _ in range(streams):
        bus = await Bus.connect(nats_server.url, name="test")
        await bus.close()
    bus = await Bus.connect(nats_server.url, name="test")
    try:
        names = sorted([s.config.name for s in await bus.js.streams_info()])
        assert names == ["BATCHES", "DLQ", "EVENTS", "PROMPTS", "TRAJ"]
    finally:
        await bus.close()


async def test_a_handler_past_max_handler_seconds_is_cancelled_and_its_message_comes_back(nats_server):
    """F21: keep-alive extends a running handler's deadline, so a wedged one (a paused replica, a stuck engine)
    would hold its message forever; past the ceiling it is cancelled and the message redelivered."""
    bus = await Bus.connect(nats_server.url, name="test")
    stop = asyncio.Event()
    calls: list[float] = []
    cancelled = asyncio.Event()

    async def wedged_then_fine(t: data_pb2.Trajectory) -> None:
        calls.append(asyncio.get_running_loop().time())
        if len(calls) == 1:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise
        stop.set()

    try:
        await bus.publish(SUBJECT_TRAJ_RAW, traj("wedged"), "wedged")
        task = asyncio.create_task(consume(bus, "reward", decoder(data_pb2.Trajectory), wedged_then_fine, stop,
                                           max_handler_seconds=1.0))
        await asyncio.wait_for(stop.wait(), 30)
        await asyncio.wait_for(task, 30)
        assert cancelled.is_set() and len(calls) == 2 and calls[1] - calls[0] >= 1.0
    finally:
        stop.set()
        await bus.close()
