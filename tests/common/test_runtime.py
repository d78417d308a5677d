"""ServiceRuntime's shutdown order and deadlines, sleep_or_stop and Backoff (no bus or server: stand-ins record
the order; the services' own tests run the runtime with a real nats-server and gRPC)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.runtime import Backoff, ServiceRuntime, cancel_and_wait, sleep_or_stop


async def test_shutdown_stops_drains_then_closes_in_reverse_order():
    stop, order = asyncio.Event(), []

    async def worker(name: str) -> None:
        await stop.wait()
        order.append(f"{name} ended")

    async with ServiceRuntime(object(), stop, drain_s=5) as runtime:
        runtime.on_close(lambda: order.append("bus closed"))

        async def close_rpc() -> None:
            order.append("rpc stopped")

        runtime.on_close(close_rpc)
        runtime.when_stopping(lambda: order.append("stopping"))
        runtime.when_drained(lambda: order.append("drained"))
        runtime.spawn(worker("task"), "task")
        stop.set()
    assert order == ["stopping", "task ended", "drained", "rpc stopped", "bus closed"]


async def test_the_drained_callback_lets_waiting_work_finish_and_stragglers_are_cancelled_at_the_deadline():
    stop, aborted = asyncio.Event(), asyncio.Event()
    done = []

    async def handler() -> None:          # ends only once the engine aborts it (the rollout's handlers)
        await aborted.wait()
        done.append("naked")

    async def stuck() -> None:
        await asyncio.sleep(3600)

    started = time.monotonic()
    async with ServiceRuntime(object(), stop, drain_s=0.3) as runtime:
        runtime.when_drained(aborted.set)
        runtime.spawn(handler(), "handler")
        task = runtime.spawn(stuck(), "stuck")
    assert done == ["naked"] and task.cancelled()
    assert time.monotonic() - started < 5, "two drains of 0.3 s, then the straggler is cancelled"
    assert stop.is_set(), "leaving the runtime stops the service's other loops too"


async def test_a_task_that_loses_a_cancellation_is_cancelled_again_and_one_that_ignores_all_is_returned():
    lost = []

    async def loses_the_first() -> None:  # what Python 3.11's wait_for does when the inner call completes as well
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            lost.append("first")
            asyncio.current_task().uncancel()
        await asyncio.sleep(3600)

    async def ignores_every_one() -> None:
        while not released.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                lost.append("again")

    released = asyncio.Event()
    flaky, deaf = asyncio.create_task(loses_the_first()), asyncio.create_task(ignores_every_one())
    await asyncio.sleep(0)
    started = time.monotonic()
    try:
        stuck = await cancel_and_wait([flaky, deaf], deadline=1.0, every=0.1)
        assert stuck == [deaf] and flaky.cancelled(), (stuck, flaky)
        assert lost.count("first") == 1 and lost.count("again") >= 2, lost   # cancelled again, every 0.1 s
        assert time.monotonic() - started < 5
    finally:
        released.set()  # else the deaf task outlives the test and the loop's close waits for it forever
    assert await cancel_and_wait([deaf], deadline=1.0) == [] and deaf.done()


async def test_a_body_that_raises_still_closes_what_was_opened():
    stop, closed = asyncio.Event(), []
    with pytest.raises(RuntimeError, match="start failed"):
        async with ServiceRuntime(object(), stop, drain_s=1) as runtime:
            runtime.on_close(lambda: closed.append("bus"))
            raise RuntimeError("start failed")
    assert closed == ["bus"]


async def test_a_crashed_task_stops_the_service():
    stop = asyncio.Event()

    async def crash() -> None:
        raise ValueError("boom")

    async with ServiceRuntime(object(), stop, drain_s=1) as runtime:
        runtime.spawn(crash(), "crash")
        await asyncio.wait_for(runtime.until_stopped(), 10)


async def test_sleep_or_stop_returns_early_on_stop():
    stop = asyncio.Event()
    assert await sleep_or_stop(stop, 0.01) is False
    asyncio.get_running_loop().call_later(0.05, stop.set)
    started = time.monotonic()
    assert await sleep_or_stop(stop, 30) is True
    assert time.monotonic() - started < 5


def test_backoff_doubles_to_its_cap_and_resets():
    backoff = Backoff(initial=0.5, cap=3.0)
    assert [backoff.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert backoff.next() == 0.5
