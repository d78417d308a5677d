"""Run in a fresh process (the CPU limits are read at oneDNN's first use): builds the tiny model's engine in each
dtype, generates, and prints one JSON line with what it found. `python -m tests.rollout.cpu_paths_proc MODEL`."""

from __future__ import annotations

import asyncio
import json
import sys

import torch

from services.common.cpu_features import describe
from services.rollout.engines.runner import PackedLinears
from services.rollout.engines.sequence import Sampling
from services.rollout.engines.torch_engine import EngineConfig


async def generate(model: str, dtype: str) -> dict:
    engine = EngineConfig(model_path=model, dtype=dtype, max_batch=8, max_context=128).build()
    engine.start()
    try:
        seqs = await asyncio.wait_for(engine.generate([5, 6, 7, 8], Sampling(temperature=1.0, max_new_tokens=6), n=4), 60)
    finally:
        engine.stop()
    return {"linear_path": engine.runner.linear_path, "tokens": sum(len(s.output_ids) for s in seqs),
            "finish": sorted({s.finish_reason for s in seqs}), "failed_steps": engine.stats.steps_failed}


def bf16_packing_error() -> str:
    """What oneDNN's own bf16 packing says here ("" when it runs)."""
    layer = torch.nn.Linear(8, 8).bfloat16()
    PackedLinears(torch.nn.Sequential(layer))
    try:
        layer(torch.ones(2, 8, dtype=torch.bfloat16))
    except RuntimeError as exc:
        return str(exc)
    return ""


def main() -> None:
    model = sys.argv[1]
    out = {**describe(), "bf16_packing_error": bf16_packing_error()}
    for dtype in ("float32", "bfloat16"):
        out[dtype] = asyncio.run(generate(model, dtype))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
