"""The engine behind the gateway: admission (back-pressure), submission, and snapshots of sequences in flight."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

from services.rollout.engines.sequence import Sampling
from services.rollout.gateway.budget import GroupBudget
from services.rollout.gateway.errors import ApiError


class Sampled:
    """One sequence being generated; `ids()` is a snapshot while it runs, `done` once the engine finished it."""

    def __init__(self, future: asyncio.Future, seq: Any = None, abort: Callable[[], None] | None = None) -> None:
        self.future = future
        self._seq = seq
        self._abort = abort
        self.cut = False  # the gateway stopped it (a stop string, the client left, a timeout)

    def abort(self) -> None:
        """Stop the engine generating it; with the embedded engine its ids no longer change after this."""
        if self.cut or self.future.done():
            return
        self.cut = True
        if self._abort is not None:
            self._abort()

    @property
    def done(self) -> bool:
        return self.future.done()

    def ids(self) -> list[int]:
        if self.future.done():
            return list(self.future.result().output_ids)
        return list(self._seq.output_ids) if self._seq is not None else []

    def result(self) -> Any:
        return self.future.result()

    @property
    def running(self) -> Any:
        """The engine's sequence object while it runs (None for engines without `submit`)."""
        return self._seq


class EngineBackend:
    def __init__(self, engine: Any, *, budget: GroupBudget, max_wait_s: float, poll_s: float,
                 retry_after_s: float) -> None:
        self.engine = engine
        self.budget = budget
        self.max_wait_s = max_wait_s
        self.poll_s = poll_s
        self.retry_after_s = retry_after_s
        self.max_context: int | None = getattr(getattr(engine, "scheduler", None), "max_context", None)

    @property
    def version(self) -> int:
        return int(getattr(self.engine, "version", 0))

    async def admit(self, group_id: str | None = None, group_size: int = 1) -> None:
        """Wait while the engine is paused (weight update) or, for a group's first request, while the staleness
        budget is spent; then 429. A group admitted once only waits for pauses (no session stalls mid-episode)."""
        deadline = time.monotonic() + self.max_wait_s
        while self.engine.paused or (group_id is not None and not self.budget.admit(group_id, group_size)):
            if time.monotonic() >= deadline:
                paused = bool(self.engine.paused)
                reason = "the policy is paused for a weight update" if paused else \
                    f"the policy is out of staleness budget ({self.budget.admitted} groups admitted)"
                secs = max(1, round(self.retry_after_s))
                raise ApiError(429, f"{reason}; retry after {secs}s", code="rate_limit_exceeded",
                               headers={"retry-after": str(secs), "retry-after-ms": str(int(self.retry_after_s * 1000)),
                                        "x-meshrl-paused": "1" if paused else "0"})
            await asyncio.sleep(self.poll_s)

    def submit(self, prompt_ids: list[int], sampling: Sampling, n: int, images: Any = None) -> list[Sampled]:
        loop = asyncio.get_running_loop()
        out = []
        extra = {"images": images} if images is not None else {}  # only a vision-language engine takes images
        for _ in range(n):
            fut = loop.create_future()
            if hasattr(self.engine, "submit"):
                seq = self.engine.submit(prompt_ids, sampling, lambda s, f=fut: loop.call_soon_threadsafe(_resolve, f, s),
                                         priority=True, **extra)  # an agent waits on it: ahead of queued rollout work
                abort = getattr(self.engine, "abort", None)
                out.append(Sampled(fut, seq, functools.partial(abort, seq) if abort else None))
            else:  # an engine with only `generate`: no snapshots, the text arrives when the sequence is done
                task = asyncio.ensure_future(self.engine.generate(prompt_ids, sampling, 1))
                task.add_done_callback(lambda t, f=fut: _chain(t, f))
                out.append(Sampled(fut))
        return out


def _resolve(fut: asyncio.Future, seq: Any) -> None:
    if not fut.done():
        fut.set_result(seq)


def _chain(task: asyncio.Task, fut: asyncio.Future) -> None:
    if fut.done():
        return
    if task.exception() is not None:
        fut.set_exception(task.exception())
    else:
        fut.set_result(task.result()[0])
