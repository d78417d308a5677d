"""The data plane: every JetStream stream, subject and consumer, declared once, plus the consume loop.

Publishers set `Nats-Msg-Id` (JetStream drops duplicates inside the window) and a `Meshrl-Type`
header naming the protobuf message. Consumers pull with explicit ack; a message is acked only after
its handler returned (its effect is durable). `follow` reads a subject from its start without acks
(every replica sees every message). A message that cannot be decoded, has the wrong type or
fails validation goes to `dlq.<consumer>` with the reason and is terminated; the loop keeps going.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats
import nats.errors
import nats.js.errors
from google.protobuf.message import DecodeError, Message
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StreamConfig

from services.common.contracts import data_pb2
from services.common.ids import now
from services.common.logging import get_logger

SUBJECT_PROMPTS = "prompts.work"
SUBJECT_TRAJ_RAW = "traj.raw"
SUBJECT_TRAJ_SCORED = "traj.scored"
SUBJECT_BATCHES = "batches.train"
SUBJECT_VERSIONS = "events.version"
DLQ_PREFIX = "dlq."
TYPE_HEADER = "Meshrl-Type"

M = TypeVar("M", bound=Message)


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    retention: RetentionPolicy = RetentionPolicy.LIMITS


@dataclasses.dataclass(frozen=True)
class ConsumerSpec:
    durable: str
    stream: str
    filter_subject: str
    ack_wait: float = 60.0
    max_deliver: int = 5
    max_ack_pending: int = 1024


STREAMS = (
    StreamSpec("PROMPTS", ("prompts.>",), RetentionPolicy.WORK_QUEUE),
    StreamSpec("TRAJ", ("traj.>",)),
    StreamSpec("BATCHES", ("batches.>",), RetentionPolicy.WORK_QUEUE),
    StreamSpec("EVENTS", ("events.>",)),
    StreamSpec("DLQ", ("dlq.>",)),
)

CONSUMERS = {
    spec.durable: spec
    for spec in (
        ConsumerSpec("rollout", "PROMPTS", SUBJECT_PROMPTS),
        ConsumerSpec("reward", "TRAJ", SUBJECT_TRAJ_RAW),
        # the builder acks a trajectory only once the batch holding it is published
        ConsumerSpec("builder", "TRAJ", SUBJECT_TRAJ_SCORED, ack_wait=900.0, max_ack_pending=100_000),
        ConsumerSpec("trainer", "BATCHES", SUBJECT_BATCHES, ack_wait=300.0),
        ConsumerSpec("builder-versions", "EVENTS", SUBJECT_VERSIONS),
    )
}


class InvalidMessage(ValueError):
    """A message that no retry can fix: it goes to the dead-letter subject."""


class Bus:
    """A NATS connection with the JetStream context and meshrl's streams and consumers."""

    def __init__(self, nc: nats.NATS, *, ack_wait: float | None = None) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.ack_wait = ack_wait

    @classmethod
    async def connect(cls, url: str, *, name: str, ack_wait: float | None = None) -> Bus:
        nc = await nats.connect(url, name=name, connect_timeout=5, max_reconnect_attempts=-1,
                                reconnect_time_wait=0.5)
        bus = cls(nc, ack_wait=ack_wait)
        await bus.ensure()
        return bus

    async def ensure(self) -> None:
        """Create every stream and consumer; safe to call from every service at every start."""
        for spec in STREAMS:
            config = StreamConfig(name=spec.name, subjects=list(spec.subjects), retention=spec.retention,
                                  duplicate_window=120.0)
            try:
                await self.js.add_stream(config)
            except nats.js.errors.BadRequestError:
                await self.js.update_stream(config)
        for spec in CONSUMERS.values():
            await self.js.add_consumer(spec.stream, self._consumer_config(spec))

    def _consumer_config(self, spec: ConsumerSpec) -> ConsumerConfig:
        return ConsumerConfig(durable_name=spec.durable, ack_policy=AckPolicy.EXPLICIT,
                              deliver_policy=DeliverPolicy.ALL, filter_subject=spec.filter_subject,
                              ack_wait=self.ack_wait or spec.ack_wait, max_deliver=spec.max_deliver,
                              max_ack_pending=spec.max_ack_pending)

    async def publish(self, subject: str, message: Message, msg_id: str) -> bool:
        """Publish durably; returns False when JetStream dropped it as a duplicate of `msg_id` on `subject`.

        The dedupe key is scoped by subject: a trajectory keeps its id from traj.raw to traj.scored.
        """
        assert msg_id, "every published message needs an id"
        headers = {"Nats-Msg-Id": f"{subject}/{msg_id}", TYPE_HEADER: message.DESCRIPTOR.full_name}
        ack = await self.js.publish(subject, message.SerializeToString(), headers=headers, timeout=10.0)
        return not ack.duplicate

    async def dead_letter(self, consumer: str, msg: Msg, reason: str) -> None:
        letter = data_pb2.DeadLetter(subject=msg.subject, consumer=consumer, reason=reason, data=msg.data, at=now())
        seq = msg.metadata.sequence.stream if msg.metadata else 0
        await self.publish(DLQ_PREFIX + consumer, letter, f"dlq-{consumer}-{seq}")
        get_logger().warning("dead_letter", consumer=consumer, subject=msg.subject, reason=reason)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.drain()


def decoder(message_type: type[M]) -> Callable[[Msg], M]:
    """Decode a message, refusing the wrong type or undecodable bytes with InvalidMessage."""
    expected = message_type.DESCRIPTOR.full_name

    def decode(msg: Msg) -> M:
        got = (msg.headers or {}).get(TYPE_HEADER)
        if got != expected:
            raise InvalidMessage(f"wrong message type: header {TYPE_HEADER}={got!r}, expected {expected!r}")
        try:
            return message_type.FromString(msg.data)
        except DecodeError as exc:
            raise InvalidMessage(f"undecodable {expected}: {exc}") from exc

    return decode


async def consume(bus: Bus, consumer: str, decode: Callable[[Msg], M],
                  handle: Callable[..., Awaitable[None]], stop: asyncio.Event, *,
                  concurrency: int = 1, fetch_timeout: float = 1.0, gate: asyncio.Event | None = None,
                  manual_ack: bool = False) -> None:
    """Pull from a durable consumer until `stop` is set; ack after `handle` returns.

    Up to `concurrency` handlers run at once. A handler raising InvalidMessage dead-letters the
    message; any other error naks it for redelivery (dead-lettered after `max_deliver` tries).
    While a handler runs, the message's ack deadline is extended. While `gate` is clear nothing is fetched. On stop, fetched messages that
    were not started are nak'ed and running handlers finish before this returns.
    With `manual_ack`, the handler is called as `handle(obj, msg)` and acks the message itself once
    the effect is durable (e.g. when a batch holding it is published).
    """
    spec = CONSUMERS[consumer]
    ack_wait = bus.ack_wait or spec.ack_wait
    sub = await bus.js.pull_subscribe_bind(durable=consumer, stream=spec.stream)
    running: set[asyncio.Task] = set()
    log = get_logger().bind(consumer=consumer)

    async def process(msg: Msg) -> None:
        heartbeat = asyncio.create_task(_keep_alive(msg, ack_wait / 3))
        try:
            if manual_ack:
                await handle(decode(msg), msg)
            else:
                await handle(decode(msg))
                await msg.ack_sync(timeout=10.0)
        except InvalidMessage as exc:
            await bus.dead_letter(consumer, msg, str(exc))
            await msg.term()
        except Exception as exc:
            delivered = msg.metadata.num_delivered if msg.metadata else 1
            log.exception("handler_failed", delivered=delivered, error=str(exc))
            if delivered >= spec.max_deliver:
                await bus.dead_letter(consumer, msg, f"failed {delivered} times: {exc}")
                await msg.term()
            else:
                await msg.nak(delay=1.0)
        finally:
            heartbeat.cancel()

    try:
        while not stop.is_set():
            if gate is not None and not gate.is_set():
                await _wait_either(gate, stop)
                continue
            if len(running) >= concurrency:
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                continue
            try:
                msgs = await sub.fetch(concurrency - len(running), timeout=fetch_timeout)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except nats.errors.ConnectionClosedError:
                break
            for msg in msgs:
                if stop.is_set():
                    await msg.nak()
                    continue
                task = asyncio.create_task(process(msg))
                running.add(task)
                task.add_done_callback(running.discard)
    finally:
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def follow(bus: Bus, subject: str, decode: Callable[[Msg], M], handle: Callable[[M], None],
                 stop: asyncio.Event) -> None:
    """Every message on `subject` from the start of its stream, in order, until `stop` is set.

    An ephemeral ordered consumer per caller (each replica sees everything; nothing is acked or shared).
    Messages that do not decode are skipped; `handle` is called on the event loop and must not block.
    """
    log = get_logger().bind(follow=subject)

    async def on_msg(msg: Msg) -> None:
        try:
            handle(decode(msg))
        except ValueError as exc:  # InvalidMessage included
            log.warning("follow_skipped", error=str(exc))

    sub = await bus.js.subscribe(subject, cb=on_msg, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    try:
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def _wait_either(a: asyncio.Event, b: asyncio.Event) -> None:
    tasks = [asyncio.create_task(a.wait()), asyncio.create_task(b.wait())]
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()


async def _keep_alive(msg: Msg, every: float) -> None:
    while True:
        await asyncio.sleep(max(every, 0.5))
        with contextlib.suppress(Exception):
            await msg.in_progress()
