"""A stand-alone gateway for trying the example agents without the rest of meshrl (nothing is trained).

It serves a tiny random Qwen3 (or any Hugging Face model directory with a chat template) on
http://127.0.0.1:8000 and prints one line per exported trajectory instead of publishing it.

    python examples/agents/dev_gateway.py [--model-path DIR] [--port 8000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `services`

from services.rollout.engines.torch_engine import EmbeddedEngine, EngineConfig  # noqa: E402
from services.rollout.gateway import GatewayConfig, create_app, serve_gateway  # noqa: E402
from services.rollout.gateway.config import ensure_admin_key  # noqa: E402
from services.trainer.models.tiny_qwen3 import TinyQwen3Config, build_tokenizer, padded_vocab_size  # noqa: E402


def engine_and_tokenizer(model_path: str | None, max_context: int, prefix_cache_mb: int = 512):
    if model_path:
        from transformers import AutoTokenizer

        engine = EngineConfig(model_path=model_path, max_context=max_context, prefix_cache_mb=prefix_cache_mb).build()
        return engine, AutoTokenizer.from_pretrained(model_path)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = TinyQwen3Config(max_position_embeddings=max_context).build(padded_vocab_size(tok), eos_token_id=tok.eos_token_id)
    engine = EmbeddedEngine(model.eval(), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_batch=64,
                            max_context=max_context, seed=0)
    return engine, tok


async def main(args: argparse.Namespace) -> None:
    engine, tok = engine_and_tokenizer(args.model_path, args.max_context, args.prefix_cache_mb)
    engine.start()

    async def publish(members) -> None:  # the gateway hands over a group's trajectories that ended together
        for traj in members:
            print(json.dumps({"trajectory_id": traj.trajectory_id, "task_id": traj.task_id, "reward": traj.reward,
                              "group": f"{traj.group_id}/{traj.group_size}", "prompt_tokens": len(traj.prompt_ids),
                              "completion_tokens": len(traj.completion_ids), "trained_tokens": sum(traj.loss_mask),
                              "prefix_cache_hit_tokens": engine.stats.prefix_cache_hit_tokens,
                              "engine_busy_seconds": round(engine.stats.busy_seconds, 2)}), flush=True)

    config = GatewayConfig(port=args.port, max_tokens_cap=args.max_tokens_cap)  # admin key: MESHRL_ADMIN_KEY, else
    key_file = ensure_admin_key(config, args.run_dir)                           # generated into the run directory
    if key_file is not None:
        print(f"admin key: in {key_file} (the example agents find it on their own)", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await serve_gateway(create_app(config, engine, tok, publish), config, stop)
    finally:
        engine.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--max-tokens-cap", type=int, default=256)
    parser.add_argument("--prefix-cache-mb", type=int, default=512,
                        help="the engine's prefix cache (with --model-path); 0 turns it off")
    parser.add_argument("--run-dir", default="runs/dev-gateway", help="where a generated admin key is kept")
    asyncio.run(main(parser.parse_args()))
