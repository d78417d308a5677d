"""Profile one trainer step in-process on a batch like the default job's: 64 groups x 8 samples, prompts of
~20 tokens, completions of at most 8 tokens, rewards that vary inside each group; GRPO, 4 minibatches,
the job's optimizer settings; no services, no bus.

    python -m bench.profile_trainer [--steps 5] [--profile] [--top 25]

Prints one JSON line: median wall and CPU seconds per phase (protobuf decode, pack, step); with --profile,
the top functions (cProfile) on stderr. Compare CPU times side by side: the machine is shared.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import sys
import time

import torch

from bench.profile_engine import default_model
from services.common.contracts import data_pb2
from services.trainer.batching import pack
from services.trainer.config import TrainerConfig
from services.trainer.engine import TrainerEngine
from services.trainer.optim import OptimConfig


def synthetic_batch(index: int, *, groups: int, group_size: int, max_new_tokens: int, vocab: int,
                    seed: int) -> data_pb2.TrainingBatch:
    rng = random.Random(seed)
    trajectories = []
    for g in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(16, 24))]
        for i in range(group_size):
            n = rng.randint(1, max_new_tokens)
            trajectories.append(data_pb2.Trajectory(
                trajectory_id=f"b{index}-g{g}-{i}", group_id=f"b{index}-g{g}", group_size=group_size,
                prompt_ids=prompt, completion_ids=[rng.randrange(vocab) for _ in range(n)],
                behavior_logprobs=[-rng.random() * 3 for _ in range(n)], versions=[index] * n, loss_mask=[1] * n,
                reward=float(i % 2), scored=True, finish_reason="stop" if n < max_new_tokens else "length"))
    return data_pb2.TrainingBatch(batch_id=f"batch-{index}", index=index, trajectories=trajectories)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="cProfile the steps; stats on stderr")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = TrainerConfig(model_path=args.model or default_model(), algo="grpo",
                           algo_overrides={"dynamic_sampling": True}, total_steps=150, wx_address="",
                           optim=OptimConfig(lr=5e-4, betas=(0.9, 0.99), minibatches=4, warmup_updates=10,
                                             schedule="linear", grad_clip=1.0))
    engine = TrainerEngine(config)
    vocab = engine.model.get_input_embeddings().num_embeddings
    wires = [synthetic_batch(i, groups=args.groups, group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                             vocab=vocab, seed=i).SerializeToString() for i in range(args.steps + 1)]
    profiler = cProfile.Profile() if args.profile else None
    times: dict[str, list[float]] = {"decode": [], "pack": [], "step": []}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    for i, wire in enumerate(wires):
        if profiler and i:
            profiler.enable()
        marks = [(time.perf_counter(), time.process_time())]
        batch = data_pb2.TrainingBatch.FromString(wire)
        marks.append((time.perf_counter(), time.process_time()))
        packed = pack(list(batch.trajectories), engine.pad_token_id)
        engine.check_token_ids(packed)
        marks.append((time.perf_counter(), time.process_time()))
        engine.step(packed, i)
        marks.append((time.perf_counter(), time.process_time()))
        if profiler:
            profiler.disable()
        if i:  # the first step warms up
            for name, a, b in zip(times, marks, marks[1:], strict=False):
                times[name].append(b[0] - a[0])
                cpu[name].append(b[1] - a[1])
    if profiler:
        stats = pstats.Stats(profiler, stream=sys.stderr)
        stats.sort_stats("cumulative").print_stats(args.top)
        stats.sort_stats("tottime").print_stats(args.top)
    median = lambda xs: round(sorted(xs)[len(xs) // 2], 4)  # noqa: E731
    print(json.dumps({"case": "trainer_step", "steps": args.steps, "samples": args.groups * args.group_size,
                      **{f"{k}_wall_seconds": median(v) for k, v in times.items()},
                      **{f"{k}_cpu_seconds": median(v) for k, v in cpu.items()},
                      "torch_threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
