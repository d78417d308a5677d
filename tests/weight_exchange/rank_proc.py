"""A process hosting some ranks of one side (senders or receivers) for the correctness tests.

Senders hold the reference weights sharded by their framework's rule. Receivers start zeroed (and zero
again on every pause); after every resume each writes `<out>/<rank_id>.v<version>.json` with the names
of local tensors that differ from the reference sharded by its own rule (empty: bit-exact).
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
from services.weight_exchange.client import ReceiverAgent, SenderAgent
from services.weight_exchange.client.layouts.inference import receiver_views
from services.weight_exchange.client.layouts.model import model_spec
from services.weight_exchange.client.layouts.topology import parse_side, rank_shards
from services.weight_exchange.reference import hf_reference, local_tensors

PADDING_ONLY = ("embedding.word_embeddings", "output_layer", "model.embed_tokens", "lm_head")


def check_layout(rank_id: str, tensors: dict[str, torch.Tensor], shards) -> None:
    """The layout's local tensors must be the framework's tensors (names and shapes); only a vocab shard that
    holds nothing but padding rows may be left out."""
    declared = {s.local_name: s.local_shape for s in shards}
    actual = {k: tuple(v.shape) for k, v in tensors.items() if v.numel()}
    wrong = {k: (shape, actual.get(k)) for k, shape in declared.items() if actual.get(k) != shape}
    assert not wrong, f"{rank_id}: layout shapes differ: {wrong}"
    missing = [k for k in actual if k not in declared and not k.startswith(PADDING_ONLY)]
    assert not missing, f"{rank_id}: layout lacks {missing}"


async def run(a: argparse.Namespace) -> None:
    spec = model_spec(a.model)
    side = parse_side(a.side)
    dtype = getattr(torch, a.dtype)
    ref = hf_reference(spec, a.seed, dtype)
    out = pathlib.Path(a.out)
    stops = []
    stop = asyncio.Event()
    heartbeats = []
    for rank in [int(x) for x in a.ranks.split(",")]:
        rank_id = f"{a.prefix}-{rank}"
        shards, parallel = rank_shards(spec, side, rank, a.dtype)
        tensors = local_tensors(spec, side, rank, ref)
        check_layout(rank_id, receiver_views(side.framework, tensors), shards)
        if a.role == "sender":
            agent = SenderAgent(rank_id, tensors, a.wx, transports=tuple(a.transports.split(",")), shards=shards,
                                framework=side.framework, parallel=parallel)
            await agent.open()
            heartbeats.append(asyncio.create_task(agent.keep_registered(stop, interval=2.0)))
            await agent.registered.wait()
            stops.append(agent.close)
        else:
            expected = {k: v.clone() for k, v in tensors.items()}
            for t in tensors.values():
                t.zero_()
            agent = _receiver(rank_id, tensors, expected, shards, side.framework, parallel, a.wx, out)
            server = await start_server("127.0.0.1:0", [agent.servicer()])
            heartbeats.append(asyncio.create_task(
                agent.keep_registered(stop, interval=2.0, agent_address=f"127.0.0.1:{server.port}")))
            await agent.registered.wait()
            stops.append(agent.close)
            stops.append(lambda s=server: s.stop(0))
    (out / f"{a.prefix}.ready").write_text("ok")
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await asyncio.gather(*heartbeats)
    for fn in stops:
        await fn()


def _receiver(rank_id, tensors, expected, shards, framework, parallel, wx, out: pathlib.Path) -> ReceiverAgent:
    async def on_pause() -> None:
        for t in tensors.values():
            t.zero_()

    async def on_resume(version: int) -> None:
        bad = [k for k, t in tensors.items() if not torch.equal(t.view(torch.uint8), expected[k].view(torch.uint8))]
        (out / f"{rank_id}.v{version}.json").write_text(json.dumps({"bad": bad}))

    # vLLM-Ascend: the transposed experts are written through views in the layout's (logical) shapes
    return ReceiverAgent(rank_id, receiver_views(framework, tensors), wx, on_pause=on_pause, on_resume=on_resume,
                         shards=shards, framework=framework, parallel=parallel)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("sender", "receiver"), required=True)
    ap.add_argument("--side", required=True)
    ap.add_argument("--ranks", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wx", required=True)
    ap.add_argument("--transports", default="tcp,shm,gloo")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    configure_logging(f"{a.role}-test", "warning")
    asyncio.run(run(a))


if __name__ == "__main__":
    main()
