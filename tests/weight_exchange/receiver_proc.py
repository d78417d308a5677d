"""A receiver process for the sync-path test: a tiny Qwen3 (or Qwen3-MoE) 'engine' hosting the weight agent.

After every resume it saves its tensors to `<out>/v<version>.pt` and appends the event to `<out>/events.jsonl`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import signal

import torch

from services.common.logging import configure_logging
from services.common.rpc import start_server
from services.weight_exchange.client import ReceiverAgent
from tests.weight_exchange.tiny import tiny_qwen3


async def run(args: argparse.Namespace) -> None:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = tiny_qwen3(seed=args.seed, experts=args.experts)
    events = out / "events.jsonl"

    def log(kind: str, version: int | None = None) -> None:
        with events.open("a") as f:
            f.write(json.dumps({"kind": kind, "version": version}) + "\n")

    async def on_pause() -> None:
        log("pause")
        await asyncio.sleep(args.pause_delay)

    async def on_resume(version: int) -> None:
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out / f"v{version}.pt")
        log("resume", version)

    agent = ReceiverAgent(args.rank_id, dict(model.named_parameters()), args.wx, on_pause=on_pause,
                          on_resume=on_resume)
    server = await start_server("127.0.0.1:0", [agent.servicer()])
    stop = asyncio.Event()
    heartbeat = asyncio.create_task(agent.keep_registered(stop, interval=args.heartbeat,
                                                          agent_address=f"127.0.0.1:{server.port}"))
    await agent.registered.wait()
    log("registered")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await heartbeat
    await agent.close()
    await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank-id", default="rollout-0")
    parser.add_argument("--wx", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--experts", type=int, default=0, help="> 0: the tiny Qwen3-MoE with this many experts")
    parser.add_argument("--pause-delay", type=float, default=0.0)
    parser.add_argument("--heartbeat", type=float, default=2.0)
    args = parser.parse_args()
    configure_logging("rollout-test")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
