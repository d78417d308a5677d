"""`engine.torch_threads` is the OpenMP thread count of the thread that runs the model (OpenMP keeps one per thread:
a thread that never sets it starts at the machine's default), and the thread that builds the engine is left at
one, so the process holds a single OpenMP team: a second one made libgomp throttle its spin-waits and every
parallel op ~40% slower."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from services.rollout.engines.sequence import Sampling
from services.rollout.engines.torch_engine import EngineConfig


@pytest.mark.parametrize("threads", [1, 2])
async def test_the_model_runs_on_the_engine_thread_with_torch_threads(threads, tiny_qwen3):
    before = torch.get_num_threads()
    engine = EngineConfig(model_path=str(tiny_qwen3), torch_threads=threads, max_batch=8, max_context=128).build()
    seen: list[tuple[str, int]] = []
    run = engine.runner.run

    def recording_run(step):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return run(step)

    engine.runner.run = recording_run
    engine.start()
    try:
        await asyncio.wait_for(engine.generate([5, 6, 7], Sampling(temperature=1.0, max_new_tokens=3)), 60)
        builder_threads = torch.get_num_threads()
    finally:
        engine.stop()
        torch.set_num_threads(before)
    assert seen and set(seen) == {("engine", threads)}
    assert builder_threads == 1

