"""Exported trajectories waiting to be published; transient failures are retried until they pass (ids make it
idempotent), permanent ones are dropped with a logged reason and a metric, so one bad trajectory never holds
up the ones behind it.

Sessions of one group that end together go out as one message (one publish, one delivery per hop downstream):
what is queued when the outbox turns to it is published group by group, and a member of a larger group waits
`linger_s` first for its group-mates. A group message refused for good is retried member by member, so only the
bad member is dropped.

At most `max_pending` wait (the bus may be down for long): `has_room` tells the caller before it exports, so an
end_session that finds the outbox full is refused (429) with its session left as it was, never dropped.
Each trajectory's future resolves: True once published; the permanent error once dropped; `OutboxClosed` when the
gateway shuts down before it could publish it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from services.common.contracts import data_pb2
from services.common.logging import get_logger
from services.common.runtime import cancel_and_wait
from services.rollout.gateway import metrics

Publish = Callable[[list[data_pb2.Trajectory]], Awaitable[None]]  # members of one group (and one subject)
Queued = tuple[data_pb2.Trajectory, asyncio.Future]


class OutboxClosed(RuntimeError):
    """The gateway stopped before the trajectory was published."""


def is_permanent(exc: BaseException) -> bool:
    """A ValueError (the bus's PayloadTooLarge, an invalid message) or TypeError fails the same way on every try;
    anything else (connection lost, timeout, server busy) may pass on a later one."""
    return isinstance(exc, ValueError | TypeError)


class Outbox:
    def __init__(self, publish: Publish, *, retry_s: float = 0.5, max_retry_s: float = 10.0,
                 max_pending: int = 65536, linger_s: float = 0.0) -> None:
        self._publish = publish
        self.max_pending = max_pending
        self._linger_s = linger_s
        self._retry_s = retry_s
        self._max_retry_s = max_retry_s
        self._queue: asyncio.Queue[Queued] = asyncio.Queue()
        self._unresolved: set[asyncio.Future] = set()
        self._task: asyncio.Task | None = None
        self.published = 0
        self.messages = 0   # publishes that succeeded (a group's members share one)
        self.failures = 0   # failed attempts (each transient one is retried)
        self.dropped = 0    # trajectories refused for good
        self.pending = 0    # queued or being published (retried), not yet published

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="gateway-outbox")

    def has_room(self, n: int) -> bool:
        return n == 0 or self.pending == 0 or self.pending + n <= self.max_pending

    def put(self, trajectories: list[data_pb2.Trajectory]) -> list[asyncio.Future]:
        """Queue them (callers check `has_room` first; shutdown queues what is left regardless)."""
        futures = []
        for traj in trajectories:
            fut = asyncio.get_running_loop().create_future()
            self._queue.put_nowait((traj, fut))
            self._unresolved.add(fut)
            self.pending += 1
            futures.append(fut)
        return futures

    async def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far is published or dropped (or the timeout passes)."""
        if self._task is None:
            return self._queue.empty()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._queue.join(), timeout)
        return self.pending == 0

    async def close(self, timeout: float) -> None:
        await self.flush(timeout)
        if self._task:
            await cancel_and_wait([self._task])
        if self.pending:
            get_logger().error("gateway_outbox_unpublished", pending=self.pending)
        for fut in self._unresolved:  # nobody waits forever on a trajectory that will not be published
            if not fut.done():
                fut.set_exception(OutboxClosed("the gateway stopped before the trajectory was published"))
        self._unresolved.clear()

    async def _run(self) -> None:
        while True:
            queued = [await self._queue.get()]
            if self._linger_s and queued[0][0].group_size > 1:
                await asyncio.sleep(self._linger_s)  # its group-mates ending now join the same message
            while not self._queue.empty():
                queued.append(self._queue.get_nowait())
            for members in by_group(queued):
                await self._send(members)
            for _ in queued:
                self._queue.task_done()

    async def _send(self, members: list[Queued]) -> None:
        """Publish one group's members together; refused for good, each alone (only the bad one is dropped)."""
        error = await self._deliver([traj for traj, _ in members])
        if error is not None and len(members) > 1:
            for member in members:
                await self._send([member])
            return
        for traj, fut in members:
            self.pending -= 1
            self._unresolved.discard(fut)
            if error is None:
                self.published += 1
                if not fut.done():
                    fut.set_result(True)
            else:
                self._drop(traj, error)
                if not fut.done():
                    fut.set_exception(error)
        self.messages += error is None

    async def _deliver(self, trajectories: list[data_pb2.Trajectory]) -> Exception | None:
        """Publish, retrying transient failures; None once published, else the permanent error."""
        delay = self._retry_s
        while True:
            try:
                await self._publish(trajectories)
                return None
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failures += 1
                if is_permanent(exc):
                    return exc
                # the bus is down or slow: keep the trajectories and retry
                get_logger().warning("gateway_publish_failed", group_id=trajectories[0].group_id,
                                     trajectories=len(trajectories), error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._max_retry_s)

    def _drop(self, traj: data_pb2.Trajectory, error: Exception) -> None:
        self.dropped += 1
        metrics.DROPPED.labels(type(error).__name__).inc()
        get_logger().error("gateway_trajectory_dropped", trajectory_id=traj.trajectory_id, group_id=traj.group_id,
                           bytes=traj.ByteSize(), reason=str(error))


def by_group(queued: list[Queued]) -> list[list[Queued]]:
    """The queued trajectories as one list per (group, graded or not: the subject), in the order each first came."""
    groups: dict[tuple[str, bool], list[Queued]] = {}
    for item in queued:
        groups.setdefault((item[0].group_id, item[0].scored), []).append(item)
    return list(groups.values())
