"""MoE routing replay (R3): the train/infer log-prob mismatch with and without replay, on a real MoE checkpoint.

The embedded engine generates groups with `record_routes` on (its dtype: float32 or bfloat16); the trainer's
forward then computes the log-probs of the same completions under the same weights (float32, or under bf16
autocast as `dtype: bfloat16` trains), once routing every token itself and once replaying the engine's experts.
Reported per case: the mean and max |trainer - engine| log-prob over completion tokens, the same on the rows where
at least one (token, layer) routed differently, and the fraction of (token, layer) choices that differed.

A trained router separates its experts more than a freshly initialised one; `--router-scale` < 1 divides the
router weights (the choices stay, the margins shrink) to show a router with many near-ties (many experts).

    python -m bench.routing_replay [--model DIR] [--prompts 16] [--samples 4] [--new 32] [--router-scale 1,0.1]

One JSON line per case.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pathlib
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.contracts import data_pb2
from services.common.moe_routing import routers_of, to_proto
from services.rollout.engines.sequence import Sampling
from services.rollout.engines.torch_engine import EngineConfig
from services.trainer.batching import pack
from services.trainer.forward import frozen_logp

ROOT = pathlib.Path(__file__).resolve().parent.parent


def scaled_copy(model_dir: str, scale: float, into: pathlib.Path) -> str:
    if scale == 1.0:
        return model_dir
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for router in routers_of(model).routers:
            router.weight.mul_(scale)
    model.save_pretrained(into)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(into)
    return str(into)


def rollout(model_dir: str, dtype: str, args) -> list[data_pb2.Trajectory]:
    engine = EngineConfig(model_path=model_dir, dtype=dtype, record_routes=True, max_context=512).build()
    engine.start()
    vocab = engine.vocab_size or 256
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, vocab, (16 + i % 16,), generator=g).tolist() for i in range(args.prompts)]

    async def run():
        sampling = Sampling(temperature=1.0, max_new_tokens=args.new, ignore_eos=True)
        return await asyncio.gather(*(engine.generate(p, sampling, n=args.samples) for p in prompts))
    try:
        groups = asyncio.run(asyncio.wait_for(run(), 600))
    finally:
        engine.stop()
    return [data_pb2.Trajectory(
        trajectory_id=f"t{g}-{i}", group_id=f"g{g}", prompt_ids=s.prompt_ids, completion_ids=s.output_ids,
        behavior_logprobs=s.logprobs, versions=s.versions, loss_mask=[1] * len(s.output_ids),
        routed_experts=to_proto(s.routes, len(s.prompt_ids) + len(s.output_ids)))
        for g, group in enumerate(groups) for i, s in enumerate(group)]


def mismatch(model, batch, autocast: bool) -> dict[str, float]:
    mask = batch.loss_mask.bool()
    routers = routers_of(model)
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with cast:
        replayed = frozen_logp(model, batch, 1.0)
    stats = routers.take_stats()
    unrecorded = batch.rows(torch.arange(batch.size))
    unrecorded.routes = torch.full_like(batch.routes, -1)
    with cast:
        own = frozen_logp(model, unrecorded, 1.0)
    # rows where the trainer's own routing differs from the record somewhere (counted per row, replayed again)
    differs = torch.zeros(batch.size, dtype=torch.bool)
    for row in range(batch.size):
        with cast:
            frozen_logp(model, batch.rows(torch.tensor([row])), 1.0)
        differs[row] = routers.take_stats()["routing_differed"] > 0
    out = {"routing_differed": stats["routing_differed"], "rows_with_a_different_route": float(differs.float().mean())}
    for name, logp in (("own", own), ("replay", replayed)):
        gap = (logp - batch.behav_logp).abs()
        out[f"{name}_mean"] = float(gap[mask].mean())
        out[f"{name}_max"] = float(gap[mask].max())
        rows = mask & differs[:, None]
        out[f"{name}_mean_on_rows_routed_differently"] = float(gap[rows].mean()) if rows.any() else 0.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "artifacts/models/tiny-qwen3-moe-seed0"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--router-scale", default="1,0.1")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for scale in (float(s) for s in args.router_scale.split(",")):
            model_dir = scaled_copy(args.model, scale, pathlib.Path(tmp) / f"scale-{scale}")
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            for engine_dtype in ("float32", "bfloat16"):
                batch = pack(rollout(model_dir, engine_dtype, args), pad_token_id=0)
                for trainer in ("float32", "bf16-autocast"):
                    case = {"case": f"router_scale={scale:g},engine={engine_dtype},trainer={trainer}",
                            "tokens": int(batch.loss_mask.sum()), "rows": batch.size,
                            **mismatch(model, batch, trainer == "bf16-autocast")}
                    print(json.dumps(case), flush=True)


if __name__ == "__main__":
    main()
