"""What every service's `serve()` shares: its bus connection, its lease (single-active services), its gRPC server,
its supervised background tasks, and one shutdown order.

    async with ServiceRuntime(config, stop) as runtime:
        bus = await runtime.connect_bus("builder")
        ...
        await runtime.serve_grpc([servicer])
        runtime.spawn(work(stop), "work")
        await runtime.until_stopped()

On the way out (a signal set `stop`, the body returned or raised) the runtime sets `stop`, runs the `when_stopping`
callbacks, gives the background tasks `drain_s` to end on their own, runs the `when_drained` callbacks (the rollout
stops its engine there: what is still generating ends as "abort" and its handler naks the work), waits the same
again, cancels what is left (said in the log: nothing waits without a deadline), and closes what it opened in
reverse order: the gRPC server, then the lease (released, so a standby takes over at once), then the bus.
`sleep_or_stop` and `Backoff` are the waits every loop of the services uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from services.common.logging import get_logger

DRAIN_S = 30.0  # seconds the background tasks get to end, before and after the `when_drained` callbacks


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds` or until `stop` is set, whichever comes first; True when `stop` is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=max(0.0, seconds))
    return stop.is_set()


async def cancel_and_wait(tasks: Sequence[asyncio.Task], *, deadline: float = 10.0,
                          every: float = 0.5) -> list[asyncio.Task]:
    """Cancel `tasks` and wait until they end, cancelling again every `every` s, at most `deadline` s; returns
    those still running then. Once is not enough on Python 3.11: a cancellation that lands just as an inner
    `asyncio.wait_for` completes is lost (CPython gh-86296), and the task runs on."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline
    pending = {t for t in tasks if not t.done()}
    while pending and loop.time() < give_up:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(every, max(0.0, give_up - loop.time())))
    await asyncio.gather(*(t for t in tasks if t.done()), return_exceptions=True)  # retrieve their exceptions
    return list(pending)


@dataclasses.dataclass
class Backoff:
    """Exponential back-off between retries: `initial`, doubled after each failure up to `cap`; `reset` after a
    success."""

    initial: float = 0.5
    cap: float = 5.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        assert 0 < self.initial <= self.cap and self.factor >= 1, self
        self.delay = self.initial

    def next(self) -> float:
        """The delay to wait now; the one after is longer."""
        delay, self.delay = self.delay, min(self.delay * self.factor, self.cap)
        return delay

    def reset(self) -> None:
        self.delay = self.initial


class ServiceRuntime:
    def __init__(self, config: Any, stop: asyncio.Event, *, drain_s: float = DRAIN_S) -> None:
        self.config = config
        self.stop = stop
        self.drain_s = drain_s
        self.tasks: list[asyncio.Task] = []
        self._closing = contextlib.AsyncExitStack()
        self._when_stopping: list[Callable[[], Any]] = []
        self._when_drained: list[Callable[[], Any]] = []
        self.log = get_logger()

    async def __aenter__(self) -> ServiceRuntime:
        await self._closing.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            await self._shut_down()
        finally:
            await self._closing.__aexit__(*exc_info)

    # what a service opens: each is closed on the way out, the last opened first

    async def connect_bus(self, name: str):
        """The service's NATS connection (its credentials and stream settings from the config)."""
        from services.common.auth import nats_credentials
        from services.common.bus import Bus

        c = self.config
        bus = await Bus.connect(c.nats_url, name=name, replicas=c.nats_replicas, max_bytes=c.nats_max_bytes,
                                **nats_credentials(c))
        self._closing.push_async_callback(bus.close)
        return bus

    async def hold_lease(self, bus, service: str):
        """The single-active service's lease, waiting as a standby while another instance holds it (None once
        `stop` is set meanwhile); held by a supervised task, released on the way out."""
        from services.common.lease import acquire

        lease = await acquire(bus, service, ttl=self.config.lease_seconds, stop=self.stop)
        if lease is not None:
            self._closing.push_async_callback(lease.release)  # only if still ours (revision check)
            self.spawn(lease.hold(self.stop), "lease")
        return lease

    async def serve_grpc(self, servicers: Sequence[Any], **options: Any):
        """The service's gRPC server on its `grpc_address`, with its security settings."""
        from services.common.auth import server_security
        from services.common.rpc import start_server

        rpc = await start_server(self.config.grpc_address, servicers, security=server_security(self.config),
                                 **options)
        self._closing.push_async_callback(rpc.stop)
        return rpc

    def on_close(self, close: Callable[[], Any]) -> None:
        """`close()` (a function or a coroutine function) in the closing order, after what is opened later."""
        self._closing.push_async_callback(_as_async(close))

    def when_stopping(self, callback: Callable[[], Any]) -> None:
        self._when_stopping.append(callback)

    def when_drained(self, callback: Callable[[], Any]) -> None:
        self._when_drained.append(callback)

    # background work

    def spawn(self, work: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """A supervised background task: its crash stops the service (loudly, exit code 1)."""
        return self.adopt(asyncio.create_task(work, name=name))

    def adopt(self, task: asyncio.Task) -> asyncio.Task:
        from services.common.service import supervise

        supervise([task], self.stop)
        self.tasks.append(task)
        return task

    async def until_stopped(self) -> None:
        await self.stop.wait()

    async def _shut_down(self) -> None:
        self.stop.set()
        for callback in self._when_stopping:
            await _as_async(callback)()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=self.drain_s)
        for callback in self._when_drained:
            await _as_async(callback)()
        pending = [t for t in self.tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=self.drain_s)
        late = [t for t in pending if not t.done()]
        if late:
            self.log.warning("tasks_cancelled_at_stop", tasks=[t.get_name() for t in late], after_s=2 * self.drain_s)
            stuck = await cancel_and_wait(late)
            if stuck:  # left behind: the bus and gRPC server still close, and the process exits anyway
                self.log.error("tasks_ignore_cancellation", tasks=[t.get_name() for t in stuck])
        await asyncio.gather(*(t for t in self.tasks if t.done()), return_exceptions=True)


def _as_async(fn: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
    async def call() -> Any:
        result = fn()
        if asyncio.iscoroutine(result):
            return await result
        return result
    return call
