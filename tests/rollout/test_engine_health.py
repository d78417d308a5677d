"""An engine whose every step fails, whatever the request (a kernel this CPU cannot run), turns unhealthy: it
ends what it holds with "error", refuses new work naming the cause, and the service reports NOT_SERVING and
stops pulling prompt work. A request that fails alone does not."""

from __future__ import annotations

import asyncio
import types

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.rpc import start_server
from services.rollout.engines.base import EngineUnhealthy
from services.rollout.engines.sequence import Sampling
from services.rollout.engines.torch_engine import UNHEALTHY_AFTER
from services.rollout.server import watch_health
from tests.rollout.test_engine import make_engine, tiny_model

SAMPLING = Sampling(temperature=1.0, max_new_tokens=8)
GREEDY = Sampling(temperature=0.0, max_new_tokens=8)


def failing_model(bad_token: int | None = None):
    """Raises on every forward (bad_token None), or only on inputs with a row holding `bad_token` 3 times."""
    model = tiny_model(3)
    forward = model.forward

    def broken(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if bad_token is None or (ids is not None and bool(((ids == bad_token).sum(-1) >= 3).any())):
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")
        return forward(*args, **kwargs)

    model.forward = broken
    return model


async def test_every_step_failing_turns_the_engine_unhealthy_and_refuses_work_naming_the_cause():
    engine = make_engine(failing_model(), max_batch=2)
    try:
        # 2 rows a step: three failed steps end 6 of them, the 2 still waiting end with the engine's turn
        seqs = await asyncio.wait_for(engine.generate([3, 4, 5], SAMPLING, n=2 * UNHEALTHY_AFTER + 2), 30)
        assert engine.failure is not None and "bf16 path needs the cpu support" in engine.failure
        assert [s.finish_reason for s in seqs] == ["error"] * len(seqs)
        with pytest.raises(EngineUnhealthy, match="bf16 path needs"):
            await asyncio.wait_for(engine.generate([3, 4, 5], SAMPLING), 30)
        with pytest.raises(EngineUnhealthy, match="bf16 path needs"):
            engine.submit([3, 4, 5], SAMPLING, None)
    finally:
        engine.stop()
    assert engine.stats.steps_failed == UNHEALTHY_AFTER and engine.stats.sequences_failed == len(seqs)


async def test_a_request_that_fails_alone_leaves_the_engine_healthy():
    engine = make_engine(failing_model(bad_token=9))
    try:
        for _ in range(UNHEALTHY_AFTER + 1):
            bad, good = await asyncio.wait_for(asyncio.gather(
                engine.generate([9, 9, 9], GREEDY), engine.generate([3, 4, 5], GREEDY)), 30)
            assert bad[0].finish_reason == "error" and good[0].finish_reason in ("stop", "length")
        assert engine.failure is None
        [again] = await asyncio.wait_for(engine.generate([3, 4, 5], GREEDY), 30)
        assert again.finish_reason in ("stop", "length")
    finally:
        engine.stop()


async def test_the_service_reports_not_serving_and_stops_pulling_work_once_the_engine_is_unhealthy():
    engine = types.SimpleNamespace(failure=None)
    holds: set[str] = set()
    rollout = types.SimpleNamespace(engine=engine, hold=holds.add, log=types.SimpleNamespace(error=lambda *a, **k: None))
    rpc = await start_server("127.0.0.1:0", [])
    stop = asyncio.Event()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rpc.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watcher = asyncio.create_task(watch_health(rollout, rpc, stop, every=0.05))
            await asyncio.sleep(0.2)
            assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == \
                health_pb2.HealthCheckResponse.SERVING
            engine.failure = "RuntimeError: kernel refused"
            await asyncio.wait_for(watcher, 5)
            assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
            assert holds == {"engine"}
    finally:
        stop.set()
        await rpc.stop()
