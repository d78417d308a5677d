"""A frozen model served behind the gateway's OpenAI-compatible API, never trained: an agent's user simulator
(tau2-bench runs its user on a model of its own), a judge, a teacher. The same app, engine and chat formatting
as the policy's gateway, but no bus and no weight exchange: its weights never change. Callers use its admin key
(model calls with it are never recorded); start_session is 403, so nothing it serves can reach training.

    python -m services.rollout.frozen --model-path artifacts/models/smollm2-135m-instruct --port 8100 --run-dir D

The admin key is generated into `<run_dir>/secrets/gateway_admin_key` (0600) unless MESHRL_ADMIN_KEY is set.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal

from services.common.contracts import data_pb2
from services.common.logging import configure_logging, get_logger
from services.rollout.engines.torch_engine import EngineConfig
from services.rollout.gateway import GatewayConfig, create_app, serve_gateway


@dataclasses.dataclass(kw_only=True)
class FrozenModelConfig:
    engine: EngineConfig
    gateway: GatewayConfig
    run_dir: str = ""

    def __post_init__(self) -> None:
        if not self.gateway.allow_admin_requests:
            raise ValueError("gateway.allow_admin_requests: a frozen model is called with its admin key; keep it on")
        if self.gateway.sessions_enabled:
            raise ValueError("gateway.sessions_enabled: a frozen model's calls must never reach training; keep it off")


async def _refuse_export(members: list[data_pb2.Trajectory]) -> None:
    raise AssertionError(f"a frozen model exported {members[0].trajectory_id}: it has no sessions to export")


def build_app(config: FrozenModelConfig):
    engine = config.engine.build()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.engine.model_path)
    return create_app(config.gateway, engine, tokenizer, _refuse_export, run_dir=config.run_dir or None), engine


async def serve(config: FrozenModelConfig) -> None:
    app, engine = build_app(config)
    engine.start()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    get_logger().info("frozen_model_serving", model_path=config.engine.model_path, port=config.gateway.port)
    try:
        await serve_gateway(app, config.gateway, stop)
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--max-context", type=int, default=8192)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--max-tokens-cap", type=int, default=512, help="bounds every call's max_tokens")
    p.add_argument("--run-dir", default="runs/frozen", help="where its generated admin key is kept")
    args = p.parse_args(argv)
    configure_logging("frozen")
    engine = EngineConfig(model_path=args.model_path, max_context=args.max_context, max_batch=args.max_batch,
                          dtype=args.dtype, torch_threads=args.torch_threads)
    gateway = GatewayConfig(host=args.host, port=args.port, max_tokens_cap=args.max_tokens_cap,
                            model_name="meshrl-frozen", sessions_enabled=False)
    asyncio.run(serve(FrozenModelConfig(engine=engine, gateway=gateway, run_dir=args.run_dir)))


if __name__ == "__main__":
    main()
