"""Trainer forward + backward throughput, packed vs padded, on the SmolLM2 job's batch shapes.

    python -m bench.trainer_packing [--repeats 3] [--max-tokens 256] [--threads 1]

Rows: configs/smollm2.yaml's prompts (its dataset, few-shot and chat template, through the builder's encoder) x
its group size; completions of at most its max_new_tokens: most are a reply in the few-shot's form ("a + b = c"
and the end-of-turn token), the rest random tokens of any length up to the limit (a policy at temperature 1
early in training), those that reach the limit cut there. One forward + backward of the GRPO loss per batch
(the job trains each batch as one minibatch), no optimizer step:
- padded: what the trainer's minibatch loop does today (sequence_logits, token_logp, a no-grad entropy);
- packed: forward.logp_and_entropy under packed_forwards (rows packed first-fit-decreasing, a group's prompt
  computed once, the vocabulary projection only on the trained tokens);
- packed_unshared: the same with share_prompts off (each row's prompt computed for that row);
- packed_grid: sequence_logits + token_logp + entropy under packed_forwards, i.e. packing switched on with
  step.py as it is (the logits come back on the padded grid).
Tokens are the rows' real (non-pad) prompt + completion tokens, whatever each case computes. Prints one JSON
line; medians over --repeats, the cases interleaved so that load from other processes falls on each alike, per
wall second and per CPU second of this process (steadier on a shared machine: with --threads 1 it is the
compute the case needs, whatever else runs).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from launcher.runconfig import RunConfig, RunPlan
from services.common.contracts import data_pb2
from services.trainer.algorithms import token_entropy, token_logp
from services.trainer.batching import PackedBatch, pack
from services.trainer.forward import logp_and_entropy, sequence_logits
from services.trainer.packing import PackingConfig, pack_rows, packed_forwards

ROOT = pathlib.Path(__file__).resolve().parents[1]


def job_batch(plan: RunPlan, tokenizer, seed: int) -> PackedBatch:
    builder = plan.builder
    limit = builder.sampling.max_new_tokens
    dataset = builder.dataset
    tasks = dataset.build(seed=seed, train_size=builder.batch_size, eval_size=1).train
    encode, rng = dataset.encoder(tokenizer), random.Random(seed)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    trajs = []
    for g, task in enumerate(tasks[: builder.batch_size]):
        prompt = encode(task)
        for i in range(builder.group_size):
            if rng.random() < 0.7:
                terms = task.prompt.removeprefix("Calculate ").rstrip(".")
                completion = tokenizer.encode(f"{terms} = {rng.randint(-20, 30)}", add_special_tokens=False) + [end]
            else:
                completion = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, limit))]
            completion = completion[:limit]
            n = len(completion)
            trajs.append(data_pb2.Trajectory(
                trajectory_id=f"g{g}-{i}", group_id=f"g{g}", prompt_ids=prompt, completion_ids=completion,
                behavior_logprobs=[-rng.random() for _ in range(n)], versions=[0] * n, loss_mask=[1] * n,
                reward=float(rng.random() < 0.5), finish_reason="length" if n == limit else "stop"))
    return pack(trajs, tokenizer.pad_token_id or 0)


def forward_backward(model, algo, batch: PackedBatch, advantages: torch.Tensor, case: str, packing: PackingConfig):
    model.zero_grad(set_to_none=True)
    started = time.perf_counter(), time.process_time()
    with packed_forwards(packing):
        if case.startswith("packed") and case != "packed_grid":
            logp, entropy = logp_and_entropy(model, batch, 1.0, entropy_grad=False)
        else:
            logits = sequence_logits(model, batch)
            logp = token_logp(logits, batch.input_ids[:, 1:], 1.0)
            with torch.no_grad():
                entropy = token_entropy(logits.detach(), 1.0)
    loss, _ = algo.policy_loss(logp=logp, prox_logp=None, behav_logp=batch.behav_logp, advantages=advantages,
                               loss_mask=batch.loss_mask, versions=batch.versions, current_version=0, entropy=entropy)
    loss.backward()
    return time.perf_counter() - started[0], time.process_time() - started[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "smollm2.yaml"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256, help="packing budget per bin")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {args.repeats}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    run = RunConfig.load(args.config, root=ROOT)
    plan = run.derive(seed=args.seed)
    model_path = ROOT / run.model
    if not model_path.exists():
        raise SystemExit(f"no {model_path}: run scripts/convert_smollm2.py first")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).train()
    algo = plan.trainer.build_algorithm()
    cases = {"padded": PackingConfig(), "packed": PackingConfig(enabled=True, max_tokens=args.max_tokens),
             "packed_unshared": PackingConfig(enabled=True, max_tokens=args.max_tokens, share_prompts=False),
             "packed_grid": PackingConfig(enabled=True, max_tokens=args.max_tokens)}
    rates: dict[str, list[float]] = {c: [] for c in cases}
    cpu_rates: dict[str, list[float]] = {c: [] for c in cases}
    lengths, computed = [], []
    for repeat in range(args.repeats + 1):  # the first round warms up
        batch = job_batch(plan, tokenizer, args.seed + repeat)
        advantages = algo.compute_advantages(batch.rewards, batch.group_ids, batch.loss_mask).advantages
        real = batch.attention_mask.sum(-1)
        for case, packing in cases.items():
            wall, cpu = forward_backward(model, algo, batch, advantages, case, packing)
            if repeat:
                rates[case].append(int(real.sum()) / wall)
                cpu_rates[case].append(int(real.sum()) / cpu)
        if repeat:
            lengths.append(real)
            computed.append(pack_rows(batch.input_ids, batch.attention_mask, batch.lengths, cases["packed"])
                            .forward_tokens)
    real = torch.cat(lengths)
    speed = {c: statistics.median(r) for c, r in rates.items()}
    cpu_speed = {c: statistics.median(r) for c, r in cpu_rates.items()}
    print(json.dumps({
        "case": "trainer_packing", "model": run.model, "rows": len(real) // args.repeats,
        "mean_length": round(float(real.float().mean()), 1), "max_length": int(real.max()),
        "real_tokens": int(real.sum()) // args.repeats, "padded_tokens": sum(len(x) * int(x.max()) for x in lengths)
        // args.repeats, "max_tokens": args.max_tokens, "repeats": args.repeats,
        **{f"{c}_tokens_per_second": round(v, 1) for c, v in speed.items()},
        "packed_vs_padded": round(speed["packed"] / speed["padded"], 3),
        "packed_forward_tokens": sum(computed) // args.repeats,
        **{f"{c}_tokens_per_cpu_second": round(v, 1) for c, v in cpu_speed.items()},
        "packed_vs_padded_cpu": round(cpu_speed["packed"] / cpu_speed["padded"], 3),
        "packed_unshared_vs_padded": round(speed["packed_unshared"] / speed["padded"], 3),
        "packed_grid_vs_padded": round(speed["packed_grid"] / speed["padded"], 3),
        "torch_threads": torch.get_num_threads(), "load_average_1m": round(os.getloadavg()[0], 2)}))

if __name__ == "__main__":
    main()
