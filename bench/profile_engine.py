"""Profile the embedded rollout engine in-process on a workload like the default job's: rounds of 64 prompts x
8 samples (prompts of ~20 characters), at most 8 new tokens, temperature 1, max_batch 256; no services, no bus.

    python -m bench.profile_engine [--rounds 5] [--profile] [--top 25] [--model DIR] [--dtype bfloat16]

Prints one JSON line: wall and CPU seconds per round, tokens per CPU second, engine steps per round; with
--profile, the top functions by cumulative time (cProfile) on stderr. Wall time is noisy on a shared machine:
compare CPU time (process_time), measured side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pathlib
import pstats
import random
import sys
import time

from services.rollout.engines.sequence import Sampling
from services.rollout.engines.torch_engine import EngineConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def default_model() -> str:
    models = sorted((ROOT / "artifacts" / "models").glob("tiny-qwen3-seed*"))
    if not models:
        raise SystemExit("no artifacts/models/tiny-qwen3-seed*: run `make run` once (it builds the model)")
    return str(models[0])


def prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [tokenizer.encode(f"What is {rng.randint(10, 999)} + {rng.randint(10, 999)}? ") for _ in range(count)]


async def one_round(engine, batch: list[list[int]], sampling: Sampling, group: int, arrival: float = 0.0,
                    timeout: float = 900.0) -> int:
    """All prompts at once, or (arrival > 0) one every `arrival` seconds, as prompt work trickles in from the bus;
    TimeoutError past `timeout` seconds, naming what the engine saw."""
    tasks = []
    for p in batch:
        tasks.append(asyncio.ensure_future(engine.generate(p, sampling, n=group)))
        if arrival:
            await asyncio.sleep(arrival)
    try:
        seqs = await asyncio.wait_for(asyncio.gather(*tasks), timeout)
    except TimeoutError:
        raise TimeoutError(f"profile_engine: {sum(not t.done() for t in tasks)} of {len(tasks)} prompts unfinished "
                           f"after {timeout:g}s (engine failure: {engine.failure}; steps {engine.stats.steps})") from None
    return sum(len(s.output_ids) for group_seqs in seqs for s in group_seqs)


def run(model_path: str, *, rounds: int, prompts_per_round: int, group: int, max_new_tokens: int, max_batch: int,
        threads: int, profile: bool, top: int, arrival: float = 0.0, dtype: str = "float32") -> dict:
    from transformers import AutoTokenizer

    engine = EngineConfig(model_path=model_path, max_batch=max_batch, torch_threads=threads, dtype=dtype).build()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens)
    engine.start()
    asyncio.run(one_round(engine, prompts(tokenizer, 8, 0), sampling, group))  # warm-up
    steps0 = engine.stats.steps
    profiler = cProfile.Profile() if profile else None
    wall, cpu, tokens = [], [], 0
    for r in range(rounds):
        batch = prompts(tokenizer, prompts_per_round, r + 1)
        if profiler:
            profiler.enable()
        w0, c0 = time.perf_counter(), time.process_time()
        tokens += asyncio.run(one_round(engine, batch, sampling, group, arrival))
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
        if profiler:
            profiler.disable()
    steps = engine.stats.steps - steps0
    busy = engine.stats.busy_seconds
    engine.stop()
    return {"case": "engine", "rounds": rounds, "samples_per_round": prompts_per_round * group,
            "wall_seconds_per_round": round(sorted(wall)[len(wall) // 2], 4),
            "cpu_seconds_per_round": round(sorted(cpu)[len(cpu) // 2], 4),
            "tokens_per_cpu_second": round(tokens / sum(cpu), 1), "steps_per_round": steps / rounds,
            "engine_busy_seconds_per_round": round(busy / (rounds + 1), 4), "arrival_seconds": arrival,
            "torch_threads": engine.torch_threads, "dtype": dtype}


def profile_thread(model_path: str, *, rounds: int, prompts_per_round: int, group: int, max_new_tokens: int,
                   max_batch: int, threads: int, top: int, arrival: float = 0.0, dtype: str = "float32") -> None:
    """cProfile the engine's loop thread (where the work is) over the rounds; stats to stderr."""
    import threading

    profiler = cProfile.Profile()
    original = threading.Thread.run

    def profiled(self):  # noqa: ANN001
        if self.name == "engine":
            profiler.enable()
            try:
                original(self)
            finally:
                profiler.disable()
        else:
            original(self)

    threading.Thread.run = profiled
    try:
        result = run(model_path, rounds=rounds, prompts_per_round=prompts_per_round, group=group,
                     max_new_tokens=max_new_tokens, max_batch=max_batch, threads=threads, profile=False, top=top,
                     arrival=arrival, dtype=dtype)
    finally:
        threading.Thread.run = original
    stats = pstats.Stats(profiler, stream=sys.stderr)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    print(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--arrival-ms", type=float, default=0.0, help="one prompt every this many ms (0: all at once)")
    parser.add_argument("--profile", action="store_true", help="cProfile the engine thread; stats on stderr")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    kw = dict(rounds=args.rounds, prompts_per_round=args.prompts, group=args.group,
              max_new_tokens=args.max_new_tokens, max_batch=args.max_batch, threads=args.threads,
              arrival=args.arrival_ms / 1000, dtype=args.dtype)
    model = args.model or default_model()
    if args.profile:
        profile_thread(model, top=args.top, **kw)
    else:
        print(json.dumps(run(model, profile=False, top=args.top, **kw)))


if __name__ == "__main__":
    main()
