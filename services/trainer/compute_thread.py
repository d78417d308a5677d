"""The one thread that runs a trainer process's model work, so the process holds a single OpenMP team.

OpenMP keeps a thread count per thread, and torch gives a thread that never set one the process-wide count the
first time it asks. With `torch_threads` > 1, a model built on the main thread and stepped on an executor thread
made two teams; once libgomp manages more threads than there are CPUs it almost stops spin-waiting, and every
parallel op got ~40% slower (measured on the rollout's engine, which has the same layout). So: the main thread is
fixed at one thread before anything else, and building, restoring, stepping and saving all run on this thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import TypeVar

import torch

from services.common.errors import FieldError
from services.common.torch_threads import fix_torch_threads

T = TypeVar("T")


class ComputeThread:
    """A single worker thread with `threads` OpenMP threads (0: torch's default); `call` from sync code,
    `run` from the event loop. Fixes the calling (main) thread at one thread."""

    def __init__(self, threads: int, name: str = "trainer-compute") -> None:
        if threads < 0:
            raise FieldError("torch_threads", f"must be >= 0, got {threads}")
        self.threads = threads or torch.get_num_threads()
        fix_torch_threads(1)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=fix_torch_threads, initargs=(self.threads,))

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        return self._pool.submit(fn, *args, **kwargs).result()

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
