"""Heavy request work (JSON parsing, template rendering, tokenization of large bodies; count_tokens) off the event
loop, on a few worker threads, with a bounded queue: past it, 429. Small bodies stay on the loop (a thread hop
costs more than they do)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable
from typing import TypeVar

from services.rollout.gateway.errors import ApiError

T = TypeVar("T")


class Offload:
    def __init__(self, *, workers: int, queue: int, threshold: int, retry_after_s: float = 1.0) -> None:
        self.workers = workers
        self.limit = workers + queue
        self.threshold = threshold
        self.retry_after_s = retry_after_s
        self.pending = 0          # submitted, not finished (running or queued)
        self.rejected = 0
        self.offloaded = 0        # jobs run on a worker thread so far
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    async def run(self, size: int, fn: Callable[[], T], *, always: bool = False) -> T:
        """fn() inline when `size` bytes are under the threshold (unless `always`), else on a worker thread."""
        if not always and size <= self.threshold:
            return fn()
        if self.pending >= self.limit:
            self.rejected += 1
            secs = max(1, round(self.retry_after_s))
            raise ApiError(429, f"the gateway is busy with {self.pending} large requests; retry after {secs}s",
                           code="rate_limit_exceeded", headers={"retry-after": str(secs),
                                                                "retry-after-ms": str(int(self.retry_after_s * 1000))})
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="gateway-heavy")
        loop = asyncio.get_running_loop()
        self.pending += 1
        self.offloaded += 1
        job = self._pool.submit(fn)
        job.add_done_callback(lambda _: _call_soon(loop, self._finished))  # counted until the thread is free
        return await asyncio.wrap_future(job)

    def _finished(self) -> None:
        self.pending -= 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop already closed (shutdown)
        loop.call_soon_threadsafe(fn)
