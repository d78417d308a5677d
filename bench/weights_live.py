"""The weight exchange's live path into real engines, one JSON line per case.

SmolLM2-135M-Instruct (artifacts/models, float32 by default) into two vLLM servers started side by side, each with
its own weight exchange (service, a sender over the same trainer-side HF tensors, the engine's receiver):
- `stage`: today's staged reload: the receiver writes the whole model into a /dev/shm stage in the rollout
  process, and vLLM reloads the whole model from it at the resume (`engine.vllm.weight_path: stage`);
- `worker`: each vLLM worker is the receiver of its own shard: it pulls exactly its bytes from the sender and
  commits them into its live parameters (the CPU backend's packed linears re-packed) (`weight_path: worker`).
Repeats alternate between the two. `update_seconds` is one Sync as the trainer sees it (pause -> every byte
landed -> resume), `memcpy_floor_seconds` one in-process copy of the receiver's bytes, `bytes_min` the bytes the
receiver's layout holds. After the last round each engine's greedy tokens are compared with HF's.

Then deltas (`weight_exchange.delta: true`) after real optimizer steps: AdamW on the next-token loss of a few
chat-formatted prompts, fp32 master weights, at lr 1e-6 and at configs/smollm2.yaml's 3e-5, into the `worker` vLLM
(the engine's dtype) and into the embedded engine in bfloat16 (what configs/smollm2.yaml serves). Per step:
`delta_fraction` (bytes moved, indices and values, over the receiver's full bytes in its dtype) and
`update_seconds` (beside `full_update_seconds`, full updates into the same embedded engine); at the end
`bit_identical` (the embedded engine's weights equal the master weights cast to
bf16) and `outputs_match` (vLLM's greedy tokens equal HF's).

    python -m bench.weights_live [--repeat N] [--steps N] [--dtype float32|bfloat16] [--transport shm|tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import statistics
import tempfile
import time

import torch

from services.common.logging import configure_logging

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = ROOT / "artifacts" / "models" / "smollm2-135m-instruct"
PATHS = ("stage", "worker")
PROMPT = [1, 4093, 198, 1780, 314, 216, 33, 31, 1232, 216, 34, 39, 47, 2, 198, 1, 520, 9531, 198]


def available() -> str:
    """Empty when the case can run here, else why not."""
    if not (ROOT / ".venv-vllm" / "bin" / "python").exists():
        return ".venv-vllm is absent (make vllm-env)"
    if not (MODEL / "model.safetensors").exists():
        return "artifacts/models/smollm2-135m-instruct is absent (meshrl model smollm2)"
    return ""


def memcpy_floor(num_bytes: int, repeats: int = 3) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return min(times)


async def measure(repeat: int, steps: int, dtype: str, transport: str, log_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from services.rollout.engines.sequence import Sampling
    from services.rollout.engines.vllm_engine import VLLMConfig
    from services.weight_exchange.bench.local import engine_receiver, local_exchange

    hf = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=getattr(torch, dtype)).eval()
    params = dict(hf.named_parameters())
    engines = {}
    async with contextlib.AsyncExitStack() as stack:
        for path in PATHS:
            config = VLLMConfig(weight_path=path, extra_args=["--enforce-eager"], startup_timeout=900.0,
                                log_file=f"{log_dir}/vllm-{path}.log")
            engine = config.build(model_path=str(MODEL), max_batch=8, max_context=512, dtype=dtype, seed=0)
            stack.callback(engine.stop)
            await asyncio.to_thread(engine.start)
            engines[path] = (engine, await stack.enter_async_context(local_exchange(params, engine_receiver(engine))))
        times: dict[str, list[float]] = {p: [] for p in PATHS}
        parts: dict[str, list[dict]] = {p: [] for p in PATHS}
        moved: dict[str, int] = {}
        for r in range(repeat + 1):                      # round 0 warms up (first touches of every page)
            for path in PATHS if r % 2 else PATHS[::-1]:
                engine, wx = engines[path]
                started = time.perf_counter()
                reply = await wx.update(engine.version + 1, transport=transport, verify=False)  # the default
                if r:
                    times[path].append(time.perf_counter() - started)
                    parts[path].append(dict(getattr(engine, "last_update", {})))
                moved[path] = reply.bytes_moved
        for path in PATHS:      # a checked update each (raises on a checksum mismatch)
            engine, wx = engines[path]
            await wx.update(engine.version + 1, transport=transport, verify=True)
        with torch.no_grad():
            expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        expected_ids = expected[0, len(PROMPT):].tolist()
        lines = []
        for path in PATHS:
            engine, wx = engines[path]
            bytes_min = sum(s.num_bytes for s in wx.receiver.shards)
            floor = memcpy_floor(bytes_min)
            seq = (await engine.generate(PROMPT, Sampling(temperature=0.0, max_new_tokens=12)))[0]
            update = statistics.median(times[path])
            lines.append({"case": "vllm_weight_sync", "path": path, "model": MODEL.name, "dtype": dtype,
                          "transport": transport, "bytes_moved": moved[path], "bytes_min": bytes_min,
                          "update_seconds": round(update, 4), "update_seconds_all": [round(t, 4) for t in times[path]],
                          "memcpy_floor_seconds": round(floor, 4), "update_over_floor": round(update / floor, 2),
                          **worker_parts(parts[path], floor),
                          "checksum_ok": True, "outputs_match": seq.output_ids == expected_ids[:len(seq.output_ids)],
                          "repeats": repeat, "load_average": round(os.getloadavg()[0], 2)})
        stage, worker = (statistics.median(times[p]) for p in PATHS)
        lines.append({"case": "vllm_weight_sync_ratio", "stage_over_worker": round(stage / worker, 2),
                      "repeats": repeat})
        for line in lines:
            print(json.dumps(line), flush=True)
        engine, _ = engines["worker"]
        for lr in LRS:
            for line in await measure_deltas(engine, lr, steps, transport):
                print(json.dumps(line), flush=True)


def worker_parts(parts: list[dict], floor: float) -> dict:
    """The workers' own split of an update (weight_path worker): pulling the bytes, committing them (copies and
    the CPU backend's re-packing)."""
    if not parts or "pull_seconds" not in parts[0]:
        return {}
    out = {k: round(statistics.median(p[k] for p in parts), 4) for k in ("pull_seconds", "commit_seconds")}
    return {**out, "pull_over_floor": round(out["pull_seconds"] / floor, 2)}


LRS = (1e-6, 3e-5)
TEXTS = ["<|im_start|>user\nCalculate 4 + 3.<|im_end|>\n<|im_start|>assistant\n4 + 3 = 7<|im_end|>",
         "<|im_start|>user\nCalculate 9 - 5.<|im_end|>\n<|im_start|>assistant\n9 - 5 = 4<|im_end|>",
         "<|im_start|>user\nCalculate 6 + 8.<|im_end|>\n<|im_start|>assistant\n6 + 8 = 14<|im_end|>"]


async def measure_deltas(vllm_engine, lr: float, steps: int, transport: str) -> list[dict]:
    """`steps` AdamW steps from the checkpoint at `lr`; after each, a delta sync into the vLLM engine and into an
    embedded bf16 engine (each its own exchange: timed apart)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.rollout.engines.sequence import Sampling
    from services.rollout.engines.torch_engine import EngineConfig
    from services.weight_exchange.bench.local import engine_receiver, local_exchange

    master = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32)
    params = dict(master.named_parameters())
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    optimizer = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=0.0)
    embedded = EngineConfig(model_path=str(MODEL), dtype="bfloat16", max_batch=8, max_context=512).build()
    embedded.start()
    engines = {"vllm": vllm_engine, "embedded": embedded}
    dtypes = {"vllm": vllm_engine.dtype, "embedded": "bfloat16"}
    found: dict[str, dict] = {name: {"fractions": [], "seconds": [], "deltas": []} for name in engines}
    try:
        async with contextlib.AsyncExitStack() as stack:
            exchanges = {name: await stack.enter_async_context(local_exchange(
                params, engine_receiver(e), delta=True, full_every=steps + 2)) for name, e in engines.items()}
            for name, wx in exchanges.items():      # the checkpoint, in full: every receiver starts from it
                await wx.update(engines[name].version + 1, transport=transport)
            for _ in range(steps):
                loss = master(**batch, labels=batch["input_ids"]).loss
                loss.backward()
                versions = {name: e.version + 1 for name, e in engines.items()}
                for wx in exchanges.values():       # the step inside every sender's update bracket, untimed
                    wx.sender.begin_update()
                optimizer.step()
                optimizer.zero_grad()
                for name, wx in exchanges.items():
                    wx.sender.end_update(versions[name])
                for name, wx in exchanges.items():
                    started = time.perf_counter()
                    reply = await wx.update(versions[name], transport=transport)
                    found[name]["seconds"].append(time.perf_counter() - started)
                    found[name]["fractions"].append(reply.bytes_moved / reply.bytes_full)
                    found[name]["deltas"].append(reply.delta)
                    found[name]["bytes_full"] = reply.bytes_full
            with torch.no_grad():
                expected = master.generate(torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=12,
                                           do_sample=False)[0, len(PROMPT):].tolist()
            seq = (await vllm_engine.generate(PROMPT, Sampling(temperature=0.0, max_new_tokens=12)))[0]
            found["vllm"]["outputs_match"] = seq.output_ids == expected[:len(seq.output_ids)]
            live = embedded.named_parameters()
            found["embedded"]["bit_identical"] = all(torch.equal(live[n], params[n].detach().to(live[n].dtype))
                                                     for n in live if n in params)
        # beside the deltas, full updates into the same embedded engine (the bytes move whatever changed)
        async with local_exchange(params, engine_receiver(embedded)) as wx:
            full = []
            for _ in range(3):
                started = time.perf_counter()
                await wx.update(embedded.version + 1, transport=transport)
                full.append(time.perf_counter() - started)
            found["embedded"]["full_update_seconds"] = round(statistics.median(full), 3)
    finally:
        embedded.stop()
    return [{"case": "delta_sync", "engine": name, "dtype": dtypes[name], "lr": lr, "steps": steps, "transport": transport, "all_deltas": all(f["deltas"]),
             "delta_fraction": [round(x, 4) for x in f["fractions"]], "bytes_full": f["bytes_full"],
             "update_seconds": [round(x, 3) for x in f["seconds"]],
             **{k: f[k] for k in ("outputs_match", "bit_identical", "full_update_seconds") if k in f},
             "load_average": round(os.getloadavg()[0], 2)} for name, f in found.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per learning rate (delta cases)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--transport", default="shm", choices=("shm", "tcp"))
    a = ap.parse_args()
    configure_logging("bench", "warning")  # stdout carries only the JSON lines; logs go to stderr
    why = available()
    if why:
        print(json.dumps({"case": "vllm_weight_sync", "skipped": why}), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="meshrl-bench-vllm-") as log_dir:
        asyncio.run(measure(a.repeat, a.steps, a.dtype, a.transport, log_dir))


if __name__ == "__main__":
    main()
