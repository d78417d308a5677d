"""The data plane: every JetStream stream, subject and consumer, declared once, plus the consume loop.

Publishers set `Nats-Msg-Id` (JetStream drops duplicates inside the window) and a `Meshrl-Type`
header naming the protobuf message. Consumers pull with explicit ack; a message is acked only after
its handler returned (its effect is durable). `follow` reads a subject from its start without acks
(every replica sees every message). A message that cannot be decoded, has the wrong type or
fails validation goes to `dlq.<consumer>` with the reason and is terminated; the loop keeps going,
and so does a message delivered `max_deliver` times without an ack (its handler crashed or hung).

Every call rides out an unreachable server: publishes retry with the same `Nats-Msg-Id` until
`PUBLISH_DEADLINE`, the consume loop backs off and fetches again, `follow` re-creates its consumer
where it stopped. Nothing here exits a service on a transient error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats
import nats.errors
import nats.js.errors
from google.protobuf.message import DecodeError, Message
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StreamConfig

from services.common.config import DEFAULT_MAX_BYTES
from services.common.contracts import data_pb2
from services.common.errors import FieldError
from services.common.ids import now
from services.common.logging import get_logger
from services.common.runtime import Backoff, cancel_and_wait

SUBJECT_PROMPTS = "prompts.work"
SUBJECT_TRAJ_RAW = "traj.raw"
SUBJECT_TRAJ_SCORED = "traj.scored"
SUBJECT_BATCHES = "batches.train"
SUBJECT_VERSIONS = "events.version"
DLQ_PREFIX = "dlq."
TYPE_HEADER = "Meshrl-Type"

M = TypeVar("M", bound=Message)
T = TypeVar("T")


DAY = 86400.0
PUBLISH_DEADLINE = 300.0   # seconds a publish keeps retrying through an outage before it raises
HEADER_ROOM = 4096         # bytes of max_payload kept for a message's headers: a publish carries the rest


class PeersOffline(ConnectionError):
    """JetStream cannot place a replicated stream yet: a cluster node is (still) offline to the meta leader."""


NO_SUITABLE_PEERS = 10005  # JetStream's err_code for "no suitable peers for placement"
NO_STORAGE = 10047         # "insufficient storage resources available": a byte cap the server cannot reserve
STREAM_IN_USE = 10058      # "stream name already in use with a different configuration"
TRANSIENT = (nats.errors.TimeoutError, TimeoutError, nats.errors.NoRespondersError,
             nats.errors.ConnectionReconnectingError, nats.errors.ConnectionClosedError,
             nats.errors.OutboundBufferLimitError, nats.errors.StaleConnectionError,
             nats.js.errors.ServiceUnavailableError, ConnectionError)


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    retention: RetentionPolicy = RetentionPolicy.LIMITS
    max_age: float = 0.0       # seconds; 0 = forever
    share: float = 0.0         # its part of the data plane's byte budget (Bus.max_bytes); 0: no byte cap


@dataclasses.dataclass(frozen=True)
class ConsumerSpec:
    durable: str
    stream: str
    filter_subject: str
    ack_wait: float = 60.0
    max_deliver: int = 5
    max_ack_pending: int = 1024
    # a handler running longer is cancelled and its message nak'ed (redelivered, maybe to a healthy replica):
    # keep-alive extends a running handler's ack deadline, so without a ceiling a wedged one holds it forever
    max_handler_seconds: float = 900.0


# BATCHES keeps every batch (subject batches.train.<index>) so a restarted trainer re-reads by index and a
# restarted builder knows which groups it batched; limits bound what a long run keeps. A stream's byte cap is
# reserved on the server when the stream is declared, so the caps together must fit its max_file_store
# (by default 75% of the free disk where the server started).
STREAMS = (
    StreamSpec("PROMPTS", ("prompts.>",), RetentionPolicy.WORK_QUEUE),
    StreamSpec("TRAJ", ("traj.>",), max_age=7 * DAY, share=0.3),
    StreamSpec("BATCHES", ("batches.>",), max_age=7 * DAY, share=0.45),
    StreamSpec("EVENTS", ("events.>",), max_age=30 * DAY, share=0.04),
    StreamSpec("DLQ", ("dlq.>",), max_age=30 * DAY, share=0.04),
)
# the builder's three buckets take the rest of the budget: the batch blobs (object store, batches over max_payload;
# pruned once two checkpoints cover them), the dataset images that work and trajectories name by digest (object
# store, services.common.images) and its ledger (key-value). The single-active leases hold 1 MiB each.
BLOBS_SHARE = 0.12
IMAGES_SHARE = 0.03
LEDGER_SHARE = 0.02
MIN_MAX_BYTES = 64 << 20

CONSUMERS = {
    spec.durable: spec
    for spec in (
        ConsumerSpec("rollout", "PROMPTS", SUBJECT_PROMPTS, ack_wait=15.0, max_handler_seconds=3600.0),
        ConsumerSpec("reward", "TRAJ", SUBJECT_TRAJ_RAW, ack_wait=15.0),
        # the builder acks a trajectory only once the batch holding it is published; it keeps the ones it
        # holds alive (in_progress), so a dead builder's come back after ack_wait
        ConsumerSpec("builder", "TRAJ", SUBJECT_TRAJ_SCORED, ack_wait=10.0, max_ack_pending=100_000),
    )
}


def declared_consumers(user: str) -> tuple[str, ...] | None:
    """The durables a connection as `user` declares (None: all). A service identity may create or update only
    its own durable, named after it (services.common.credentials), so it declares that one or none; without a
    user (no auth: tests, local runs) or as the operator (services.common.auth.OPERATOR) every durable."""
    if not user or user == "operator":
        return None
    return (user,) if user in CONSUMERS else ()


def check_max_bytes(max_bytes: int) -> None:
    if max_bytes != -1 and max_bytes < MIN_MAX_BYTES:
        raise FieldError("nats_max_bytes", f"{max_bytes} is under the least budget {MIN_MAX_BYTES} bytes "
                         "(or -1: no byte caps)")


class InvalidMessage(ValueError):
    """A message that no retry can fix: it goes to the dead-letter subject."""


class PayloadTooLarge(ValueError):
    """A message over the server's max_payload (callers store it out of band)."""


class Bus:
    """A NATS connection with the JetStream context and meshrl's streams and consumers.

    `url` may list several servers (comma-separated: a cluster); `replicas` is the streams' replication;
    `max_bytes` the byte budget the capped streams share (-1: no caps, only their ages bound them).
    """

    def __init__(self, nc: nats.NATS, *, ack_wait: float | None = None, replicas: int = 1,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        check_max_bytes(max_bytes)
        self.nc = nc
        self.js = nc.jetstream(timeout=10.0)
        self.ack_wait = ack_wait
        self.replicas = replicas
        self.max_bytes = max_bytes
        # who may rewrite a stream whose settings differ (services.common.credentials: the builder, the operator;
        # anyone without auth): another identity's update would be refused and retried until its deadline
        self.may_update_streams = True

    @classmethod
    async def connect(cls, url: str, *, name: str, ack_wait: float | None = None, replicas: int = 1,
                      max_bytes: int = DEFAULT_MAX_BYTES, declare: bool = True, deadline: float = 600.0,
                      user: str = "", password: str = "", creds_file: str = "", inbox_prefix: str = "") -> Bus:
        """Connect (retrying while the server is unreachable, up to `deadline` s) and declare everything
        (unless `declare` is False: a reader that leaves the streams as the services declared them).

        Credentials: `user` and `password`, or an nkeys/JWT `creds_file` (see services.common.auth.nats_credentials).
        With a user, replies come to `_INBOX.<user>.>` (unless `inbox_prefix` says otherwise), the only inboxes
        the server's permissions let that user subscribe to.
        """
        log = get_logger().bind(nats=name)
        servers = [u.strip() for u in url.split(",") if u.strip()]
        if not servers:
            raise FieldError("nats_url", "empty")
        check_max_bytes(max_bytes)
        auth: dict = {}
        if user:
            auth.update(user=user, password=password)
        if creds_file:
            auth["user_credentials"] = creds_file
        if inbox_prefix or user:
            auth["inbox_prefix"] = inbox_prefix or inbox_for(user)

        refused: asyncio.Future | None = None  # the current connect attempt's: set when the server refuses the user

        async def on_error(exc: Exception) -> None:
            if refused is not None and not refused.done() and (isinstance(exc, nats.errors.AuthorizationError)
                                                                or "authorization violation" in str(exc).lower()):
                refused.set_result(exc)
            if not isinstance(exc, (OSError, nats.errors.UnexpectedEOF)):  # reconnect attempts are logged once
                log.warning("nats_error", error=repr(exc))

        async def on_disconnected() -> None:
            log.warning("nats_disconnected")

        async def on_reconnected() -> None:
            log.info("nats_reconnected")

        async def attempt() -> nats.NATS:
            """One connect; nats-py retries a refused user forever, so a refusal ends it with an error instead."""
            nonlocal refused
            refused = asyncio.get_running_loop().create_future()
            connecting = asyncio.ensure_future(nats.connect(
                servers, name=name, connect_timeout=5, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                error_cb=on_error, disconnected_cb=on_disconnected, reconnected_cb=on_reconnected,
                pending_size=64 << 20, **auth))
            await asyncio.wait([connecting, refused], return_when=asyncio.FIRST_COMPLETED)
            if connecting.done():
                return connecting.result()
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await connecting
            raise NatsAuthError(f"nats_user: the server at {url} refused {user or 'a connection without a user'!r} "
                                "(authorization violation): check nats_user and nats_password_file")

        nc = await retry(attempt, what=f"connect to {url}", deadline=deadline,
                         errors=(*TRANSIENT, OSError, nats.errors.NoServersError))
        bus = cls(nc, ack_wait=ack_wait, replicas=replicas, max_bytes=max_bytes)
        bus.may_update_streams = not user or user in ("builder", "operator")
        if declare:
            owned = declared_consumers(user)
            await retry(lambda: bus.ensure(owned), what="declare streams", deadline=deadline)
        return bus

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    async def ensure(self, consumers: tuple[str, ...] | None = None) -> None:
        """Create every stream and the `consumers` (default: every durable); safe to call at every start."""
        for spec in STREAMS:
            config = StreamConfig(name=spec.name, subjects=list(spec.subjects), retention=spec.retention,
                                  duplicate_window=120.0, max_age=spec.max_age or None,
                                  max_bytes=self.stream_max_bytes(spec), num_replicas=self.replicas)
            try:
                await self._declare_stream(config)
            except nats.js.errors.APIError as exc:
                raise self.storage_refused(exc, f"stream {spec.name}", config.max_bytes or -1) from exc
        for durable in CONSUMERS if consumers is None else consumers:
            consumer = CONSUMERS[durable]
            await self.js.add_consumer(consumer.stream, self._consumer_config(consumer))

    async def _declare_stream(self, config: StreamConfig) -> None:
        try:
            await self.js.add_stream(config)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code == NO_SUITABLE_PEERS and "offline" in (exc.description or ""):
                # a cluster forming or a node restarting: retried
                raise PeersOffline(f"stream {config.name}: {exc.description}") from exc
            if exc.err_code == NO_SUITABLE_PEERS:
                raise FieldError("nats_replicas", f"JetStream cannot place {self.replicas} replicas of stream "
                                 f"{config.name} ({exc.description}); use at most the cluster's node count") from exc
            if exc.err_code == STREAM_IN_USE and not self.may_update_streams:  # the builder's settings stand
                get_logger().warning("stream_settings_differ", stream=config.name, error=exc.description,
                                     reason="this service's nats_max_bytes / nats_replicas differ from the stream's: "
                                            "the builder's are in force")
                return
            await self.js.update_stream(config)

    def stream_max_bytes(self, spec: StreamSpec) -> int:
        return self.share_bytes(spec.share)

    def storage_refused(self, exc: Exception, what: str, asked: int) -> Exception:
        """The error to raise for a refused declaration: a ValueError naming nats_max_bytes when the server had no
        room to reserve `asked` bytes for `what`, else `exc` itself."""
        if getattr(exc, "err_code", None) != NO_STORAGE:
            return exc
        return ValueError(
            f"nats_max_bytes: the JetStream server cannot reserve {asked} bytes for {what} "
            f"({getattr(exc, 'description', exc)}); "
            f"lower nats_max_bytes (now {self.max_bytes}, split between the capped streams and buckets) or raise "
            "the server's jetstream max_file_store")

    def share_bytes(self, share: float) -> int:
        """`share` of the budget in bytes (-1: no cap, when the budget is -1 or the share 0)."""
        return int(share * self.max_bytes) if share and self.max_bytes > 0 else -1

    def _consumer_config(self, spec: ConsumerSpec) -> ConsumerConfig:
        # max_deliver is counted by `consume` (dead letter with the reason), never by the server, which
        # would silently stop redelivering
        return ConsumerConfig(durable_name=spec.durable, ack_policy=AckPolicy.EXPLICIT,
                              deliver_policy=DeliverPolicy.ALL, filter_subject=spec.filter_subject,
                              ack_wait=self.ack_wait or spec.ack_wait, max_deliver=-1,
                              max_ack_pending=spec.max_ack_pending, num_replicas=self.replicas)

    async def publish(self, subject: str, message: Message, msg_id: str, *,
                      deadline: float = PUBLISH_DEADLINE, headers: dict[str, str] | None = None) -> bool:
        """Publish durably; returns False when JetStream dropped it as a duplicate of `msg_id` on `subject`.

        The dedupe key is scoped by subject: a trajectory keeps its id from traj.raw to traj.scored.
        Retries with the same id through an outage (at most `deadline` s); PayloadTooLarge when over max_payload.
        """
        assert msg_id, "every published message needs an id"
        data = message.SerializeToString()
        if len(data) > self.max_payload - HEADER_ROOM:
            raise PayloadTooLarge(f"{message.DESCRIPTOR.full_name} {msg_id}: {len(data)} bytes is over the "
                                  f"server's max_payload {self.max_payload}")
        hdrs = {"Nats-Msg-Id": f"{subject}/{msg_id}", TYPE_HEADER: message.DESCRIPTOR.full_name, **(headers or {})}

        async def once() -> bool:
            ack = await self.js.publish(subject, data, headers=hdrs, timeout=10.0)
            return not ack.duplicate

        return await retry(once, what=f"publish {subject}", deadline=deadline)

    async def dead_letter_counts(self) -> dict[str, int]:
        """Messages in the dead-letter stream, by consumer."""
        subjects = await self.stream_subjects("DLQ", DLQ_PREFIX + ">")
        return {subject.removeprefix(DLQ_PREFIX): n for subject, n in subjects.items()}

    async def stream_subjects(self, stream: str, subjects_filter: str) -> dict[str, int]:
        """Every subject of `stream` under the filter, with its message count, page by page. The stream's leader
        answers, so the list is complete even while a cluster node is down (a key-value `keys()` reads through
        an ordered consumer, which can end early when a replica just lost its leader)."""
        subjects: dict[str, int] = {}
        while True:
            request = json.dumps({"subjects_filter": subjects_filter, "offset": len(subjects)}).encode()
            reply = json.loads((await self.nc.request(f"$JS.API.STREAM.INFO.{stream}", request, timeout=10.0)).data)
            if "error" in reply:
                raise nats.js.errors.APIError.from_error(reply["error"])
            page = reply.get("state", {}).get("subjects") or {}
            subjects.update(page)
            if not page or len(subjects) >= reply.get("total", 0):
                return subjects

    async def dead_letter(self, consumer: str, msg: Msg, reason: str) -> None:
        seq = msg.metadata.sequence.stream if msg.metadata else 0
        await self.dead_letter_data(consumer, msg.subject, msg.data, reason, key=str(seq),
                                    type=(msg.headers or {}).get(TYPE_HEADER, ""))

    async def dead_letter_data(self, consumer: str, subject: str, data: bytes, reason: str, *, key: str,
                               type: str = "") -> None:  # noqa: A002 - the letter's field
        """Dead-letter what `consumer` read from `subject` (by other means than a fetched message); `key`
        makes the letter's dedupe id, `type` names the protobuf message `data` holds."""
        letter = data_pb2.DeadLetter(subject=subject, consumer=consumer, reason=reason, data=data, at=now(), type=type)
        await self.publish(DLQ_PREFIX + consumer, letter, f"dlq-{consumer}-{key}")
        get_logger().warning("dead_letter", consumer=consumer, subject=subject, reason=reason)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.drain()


class NatsAuthError(ValueError):
    """The NATS server refused this service's user or password (a configuration error: not retried)."""


def inbox_for(user: str) -> str:
    """The inbox prefix of a NATS user (its subscribe permission covers `<prefix>.>` only)."""
    return "_INBOX." + "".join(c if c.isalnum() or c in "-_" else "_" for c in user)


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


async def retry(call: Callable[[], Awaitable[T]], *, what: str, deadline: float = PUBLISH_DEADLINE,
                errors: tuple[type[BaseException], ...] = TRANSIENT) -> T:
    """`call()` again (back-off 0.2 s doubling to 5 s) while it fails with one of `errors` (transient ones),
    up to `deadline` s."""
    give_up = now() + deadline
    backoff = Backoff(initial=0.2, cap=5.0)
    while True:
        try:
            return await call()
        except errors as exc:
            delay = backoff.next()
            if now() + delay > give_up:
                raise
            get_logger().warning("nats_retry", what=what, retry_in=delay, error=repr(exc))
            await asyncio.sleep(delay)


async def consume(bus: Bus, consumer: str, decode: Callable[[Msg], M],
                  handle: Callable[..., Awaitable[None]], stop: asyncio.Event, *,
                  concurrency: int = 1, fetch_timeout: float = 1.0, gate: asyncio.Event | None = None,
                  manual_ack: bool = False, max_handler_seconds: float | None = None) -> None:
    """Pull from a durable consumer until `stop` is set; ack after `handle` returns.

    The ack is not confirmed by the server (no round trip per message): if it is lost (the connection drops
    just then), the message comes back after the ack deadline and is handled again, which every handler
    tolerates (its publishes carry the message's id, deduplicated by JetStream).

    Up to `concurrency` handlers run at once. A handler raising InvalidMessage dead-letters the
    message; any other error naks it for redelivery; a message delivered more than `max_deliver`
    times (failed, or its handler's process died) is dead-lettered with the reason. While a handler runs,
    the message's ack deadline is extended, up to `max_handler_seconds` (the consumer's own by default): then
    the handler is cancelled and the message nak'ed. While `gate` is clear nothing is fetched. On stop, fetched
    messages that were not started are nak'ed and running handlers finish before this returns. A lost
    server is waited out (back-off), never raised.
    With `manual_ack`, the handler is called as `handle(obj, msg)` and acks the message itself once
    the effect is durable (e.g. when a batch holding it is published).
    """
    spec = CONSUMERS[consumer]
    ack_wait = bus.ack_wait or spec.ack_wait
    sub = await retry(lambda: bus.js.pull_subscribe_bind(durable=consumer, stream=spec.stream),
                      what=f"bind {consumer}", deadline=float("inf"))
    running: set[asyncio.Task] = set()
    handling: dict[int, list] = {}  # id(message) -> [message, when its deadline was last extended] (keep-alive)
    log = get_logger().bind(consumer=consumer)

    async def process(msg: Msg) -> None:
        delivered = msg.metadata.num_delivered if msg.metadata else 1
        handling[id(msg)] = [msg, time.monotonic()]
        try:
            if delivered > spec.max_deliver:
                await bus.dead_letter(consumer, msg, f"not acked after {delivered - 1} deliveries "
                                                     "(its handler failed, hung or its process died)")
                await msg.term()
                return
            limit = spec.max_handler_seconds if max_handler_seconds is None else max_handler_seconds
            ceiling = asyncio.timeout(limit)
            try:
                async with ceiling:
                    await (handle(decode(msg), msg) if manual_ack else handle(decode(msg)))
            except TimeoutError as exc:
                if ceiling.expired():
                    raise TimeoutError(f"handler ran past {limit:g}s (max_handler_seconds)") from exc
                raise
            if not manual_ack:
                await msg.ack()
        except InvalidMessage as exc:
            await bus.dead_letter(consumer, msg, str(exc))
            await msg.term()
        except Exception as exc:
            log.exception("handler_failed", delivered=delivered, error=str(exc))
            if delivered >= spec.max_deliver:
                await bus.dead_letter(consumer, msg, f"failed {delivered} times: {exc}")
                await msg.term()
            else:
                await msg.nak(delay=1.0)
        finally:
            handling.pop(id(msg), None)

    async def guarded(msg: Msg) -> None:
        try:
            await process(msg)
        except Exception as exc:  # the bus went away while acking: the message comes back by redelivery
            log.warning("settle_failed", error=repr(exc))

    keep_alive = asyncio.create_task(_keep_alive(handling, ack_wait / 3), name=f"keep-alive-{consumer}")
    backoff = Backoff(initial=0.2, cap=5.0)
    try:
        while not stop.is_set():
            if gate is not None and not gate.is_set():
                await wait_either(gate, stop)
                continue
            if len(running) >= concurrency:
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                continue
            try:
                msgs = await sub.fetch(concurrency - len(running), timeout=fetch_timeout)
                backoff.reset()
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except Exception as exc:  # server gone, leader moving, consumer re-created: wait and fetch again
                if stop.is_set():
                    break
                delay = backoff.next()
                log.warning("fetch_failed", retry_in=delay, error=repr(exc))
                await asyncio.sleep(delay)
                continue
            for msg in msgs:
                if stop.is_set():
                    with contextlib.suppress(Exception):
                        await msg.nak()
                    continue
                task = asyncio.create_task(guarded(msg))
                running.add(task)
                task.add_done_callback(running.discard)
    finally:
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        await cancel_and_wait([keep_alive])
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


FOLLOW_CHECK_EVERY = 5  # idle fetches between checks that a follower's consumer still exists and delivers


class StaleFollower(RuntimeError):
    """A follower's consumer holds messages it does not deliver (its one replica was on a lost cluster node)."""


async def _check_follower(sub) -> None:
    """Raise when the consumer is gone (NotFoundError) or has messages pending that fetches do not return: the
    caller re-creates it where it stopped. An ephemeral R1 consumer dies with its node and fetches on it only
    time out, which would leave a follower waiting forever."""
    info = await sub.consumer_info()
    if info.num_pending:
        raise StaleFollower(f"{info.num_pending} messages pending but none fetched")


async def follow(bus: Bus, subject: str, decode: Callable[[Msg], M], handle: Callable[[M], object],
                 stop: asyncio.Event, *, caught_up: asyncio.Event | None = None, stream: str = "EVENTS") -> None:
    """Every message on `subject` from the start of its stream, in order, until `stop` is set.

    Each caller has its own ephemeral consumer (each replica sees everything; nothing is acked or shared),
    re-created where it stopped when the server goes away. `handle` may be sync or async; messages that do
    not decode (or whose handler raises ValueError) are skipped, any other handler error hands the same
    message to it again (back-off): at least once. `caught_up` is set once every message that existed at the
    start was handled.
    """
    log = get_logger().bind(follow=subject)
    next_seq = 1
    backoff = Backoff(initial=0.2, cap=5.0)
    idle = 0
    while not stop.is_set():
        try:
            sub = await bus.js.pull_subscribe(subject, stream=stream, config=ConsumerConfig(
                ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=next_seq,
                inactive_threshold=60.0, num_replicas=1, mem_storage=True))
        except Exception as exc:
            delay = backoff.next()
            log.warning("follow_subscribe_failed", retry_in=delay, error=repr(exc))
            await asyncio.sleep(delay)
            continue
        try:
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(256, timeout=1.0)
                except (TimeoutError, nats.errors.TimeoutError):
                    if caught_up is not None:
                        caught_up.set()  # nothing pending
                    idle += 1
                    if idle % FOLLOW_CHECK_EVERY == 0:
                        await _check_follower(sub)
                    continue
                idle = 0
                for msg in msgs:
                    seq = msg.metadata.sequence.stream
                    try:
                        result = handle(decode(msg))
                        if asyncio.iscoroutine(result):
                            await result
                    except ValueError as exc:  # InvalidMessage included
                        log.warning("follow_skipped", error=str(exc))
                    next_seq = seq + 1  # only now: another error re-creates the consumer at `seq`
                    backoff.reset()
                    if caught_up is not None and msg.metadata.num_pending == 0:
                        caught_up.set()
        except Exception as exc:
            delay = backoff.next()
            log.warning("follow_interrupted", at=next_seq, retry_in=delay, error=repr(exc))
            await asyncio.sleep(delay)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def wait_either(a: asyncio.Event, b: asyncio.Event) -> None:
    tasks = [asyncio.create_task(a.wait()), asyncio.create_task(b.wait())]
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()


async def _keep_alive(handling: dict[int, list], every: float) -> None:
    """Every `every` s, extend the ack deadline of each message whose handler has run that long. One task per
    consumer rather than one per message: most handlers finish long before."""
    every = max(every, 0.5)
    while True:
        await asyncio.sleep(every / 2)
        due = time.monotonic() - every
        for entry in [e for e in handling.values() if e[1] <= due]:
            entry[1] = time.monotonic()
            with contextlib.suppress(Exception):
                await entry[0].in_progress()
