"""GroupCommit: what comes while a write is in flight goes out together in the next one; each caller returns when
the write holding its item is done, and gets that write's error."""

from __future__ import annotations

import asyncio

import pytest

from services.common.group_commit import GroupCommit


def test_items_that_come_during_a_write_go_together_into_the_next_one():
    async def main():
        writes: list[list[int]] = []
        release = asyncio.Event()

        async def write(items: list[int]) -> None:
            writes.append(items)
            if len(writes) == 1:
                await release.wait()

        commit = GroupCommit(write, most=3)
        first = asyncio.create_task(commit.add(0))
        await asyncio.sleep(0.01)       # the first write is in flight, alone
        later = [asyncio.create_task(commit.add(k)) for k in range(1, 6)]
        await asyncio.sleep(0.01)
        assert writes == [[0]] and not first.done()
        release.set()
        await asyncio.wait_for(asyncio.gather(first, *later), 10)
        assert writes == [[0], [1, 2, 3], [4, 5]] and commit.writes == 3

    asyncio.run(main())


def test_a_failed_write_fails_its_callers_only_and_the_next_one_goes_on():
    async def main():
        calls: list[list[str]] = []

        async def write(items: list[str]) -> None:
            calls.append(items)
            if "bad" in items:
                raise TimeoutError("server away")

        commit = GroupCommit(write)
        results = await asyncio.gather(commit.add("bad"), commit.add("with-it"), return_exceptions=True)
        assert all(isinstance(r, TimeoutError) for r in results), results
        await asyncio.wait_for(commit.add("after"), 10)
        assert calls == [["bad", "with-it"], ["after"]]

    asyncio.run(main())


def test_a_cancelled_caller_leaves_its_item_to_be_written():
    async def main():
        written: list[int] = []
        gate = asyncio.Event()

        async def write(items: list[int]) -> None:
            await gate.wait()
            written.extend(items)

        commit = GroupCommit(write)
        caller = asyncio.create_task(commit.add(7))
        await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        gate.set()
        await asyncio.wait_for(commit.add(8), 10)
        assert written == [7, 8]

    asyncio.run(main())
