"""A group commit: writes asked for while the previous one is in flight go out together as the next one.

Each caller's `add` returns once the write that holds its item is done (or raises that write's error), so every
caller keeps its own durability point, while a burst of n items costs one write instead of n. Nothing waits for a
timer: an item alone goes out at once; only items that come while a write runs wait, for that write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class GroupCommit(Generic[T]):
    def __init__(self, write: Callable[[list[T]], Awaitable[None]], *, most: int = 256, name: str = "group-commit"
                 ) -> None:
        assert most >= 1
        self.write = write
        self.most = most            # items in one write at most (a bound on its message)
        self.name = name
        self.writes = 0
        self._pending: list[tuple[T, asyncio.Future]] = []
        self._writer: asyncio.Task | None = None

    async def add(self, item: T) -> None:
        """Returns once a write holding `item` succeeded; raises that write's error otherwise (the item is then
        not retried here: the caller retries its own way). A cancelled caller's item is still written."""
        done = asyncio.get_running_loop().create_future()
        self._pending.append((item, done))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._run(), name=self.name)
        await asyncio.shield(done)

    async def _run(self) -> None:
        while self._pending:
            await asyncio.sleep(0)   # the items of callers running on this tick join the write
            taken, self._pending = self._pending[:self.most], self._pending[self.most:]
            try:
                await self.write([item for item, _ in taken])
                self.writes += 1
            except asyncio.CancelledError:
                _settle(taken, RuntimeError(f"{self.name}: cancelled before the write was confirmed"))
                raise
            except Exception as exc:  # noqa: BLE001 - each caller gets the failure of the write that held its item
                _settle(taken, exc)
                continue
            _settle(taken, None)


def _settle(taken: Sequence[tuple[object, asyncio.Future]], error: BaseException | None) -> None:
    for _, done in taken:
        if done.done():
            continue
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)
            done.exception()  # retrieved here: a caller that was cancelled never reads it
