"""Single-process prototype of meshrl's RL loop, used to pick the task, model and hyper-parameters.

    python scripts/rl_feasibility.py --seed 0 [--steps 60] [--prompts 32 --n 8 ...]

1. SFT warm start (scripts/bootstrap_model.py's recipe: stop when held-out greedy accuracy enters a band).
2. GRPO: per step sample ``prompts`` train problems x ``n`` completions at temperature ``T`` with
   the policy that is ``staleness`` versions old (as the asynchronous system would), reward 1/0 by
   extract_answer + math_verify, advantages (r - mean_group) / (std_group + 1e-6), decoupled PPO
   clipped loss (eps 0.2; ratio against proximal = current-before-update policy; behaviour
   importance weight pi_prox/pi_behav capped), token-mean over completion tokens, AdamW.
3. Held-out greedy accuracy every ``eval_every`` steps.

Everything runs with torch.set_num_threads(1), like each service in the real system. Generation and
training are timed separately: in the real system they overlap in two processes, so the RL wall
time is estimated as sum over steps of max(gen + reward, train). One JSON line per event.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bootstrap_model as bm  # noqa: E402
import math_verify  # noqa: E402

from services.builder.datasets import extract_answer, generate_split  # noqa: E402


def reward(completion: str, reference: str) -> float:
    """What the reward service computes."""
    extracted = extract_answer(completion)
    if extracted is None:
        return 0.0
    return float(bool(math_verify.verify(math_verify.parse(reference), math_verify.parse(extracted))))


def token_logprobs(model, seqs: list[list[int]], prompt_lens: list[int], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of every completion token (right-padded [B, Tc]) and the completion mask."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    tmask = torch.zeros_like(lp)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=False)):
        tmask[i, p - 1: len(s) - 1] = 1.0
    return lp, tmask


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--band", type=float, nargs=2, default=bm.BAND)
    ap.add_argument("--sft-cache", type=Path, default=None, help="save/load the SFT warm start here")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=64, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="group size")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=10, help="linear lr warm-up (optimizer steps)")
    ap.add_argument("--ppo-epochs", type=int, default=1)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--behav-cap", type=float, default=5.0)
    ap.add_argument("--staleness", type=int, default=1, help="generate with the policy this many versions old")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    log = lambda rec: print(json.dumps(rec), flush=True)  # noqa: E731
    eval_tasks = generate_split("eval", bm.EVAL_NUM, bm.EVAL_SEED)

    # 1. SFT warm start.
    t0 = time.perf_counter()
    cache = args.sft_cache / f"seed{args.seed}" if args.sft_cache else None
    if cache and (cache / "model.safetensors").exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained(cache)
        model = AutoModelForCausalLM.from_pretrained(cache, dtype=torch.float32)
        sft_summary = {"cached": str(cache)}
    else:
        tok, model = bm.build(args.seed)
        sft_summary = bm.sft(model, tok, args.seed, band=tuple(args.band), eval_tasks=eval_tasks)
        if cache:
            bm.save(model, tok, cache)
    acc0 = bm.greedy_accuracy(model, tok, eval_tasks)
    log({"phase": "sft_done", "seed": args.seed, "heldout_acc": acc0, **sft_summary,
         "params": sum(p.numel() for p in model.parameters()), "seconds": round(time.perf_counter() - t0, 2)})

    # 2. GRPO.
    torch.manual_seed(1000 + args.seed)
    rng = random.Random(f"rl/{args.seed}")
    gen = torch.Generator().manual_seed(2000 + args.seed)
    train = generate_split("train", bm.TRAIN_NUM, 1000 + args.seed)
    pad = tok.eos_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    history = [copy.deepcopy(model).eval() for _ in range(args.staleness)]  # policy versions v-s..v-1
    curve = [(0, acc0)]
    wall = gen_total = train_total = 0.0
    for step in range(1, args.steps + 1):
        behaviour = history[0] if args.staleness else model
        tasks = rng.sample(train, args.prompts)
        prompts = bm.encode_prompts(tok, tasks)
        # generation (rollout service) + reward (reward service)
        tg = time.perf_counter()
        flat_prompts = [p for p in prompts for _ in range(args.n)]
        was = behaviour.training
        behaviour.eval()
        comps, blps = bm.generate(behaviour, tok, flat_prompts, args.max_new_tokens, args.temperature, args.top_p, gen)
        behaviour.train(was)
        gen_s = time.perf_counter() - tg
        tr = time.perf_counter()
        rewards = [reward(bm.decode(tok, c), tasks[i // args.n].answer) for i, c in enumerate(comps)]
        reward_s = time.perf_counter() - tr
        # advantages (builder / trainer)
        tt = time.perf_counter()
        adv = []
        for g in range(args.prompts):
            rs = rewards[g * args.n: (g + 1) * args.n]
            mu, sd = statistics.fmean(rs), statistics.pstdev(rs)
            adv += [(r - mu) / (sd + 1e-6) for r in rs]
        keep = [i for i, a in enumerate(adv) if a != 0.0]
        stats = {"reward": round(statistics.fmean(rewards), 4),
                 "eos_rate": round(sum(1 for c in comps if c and c[-1] == pad) / len(comps), 3),
                 "mean_len": round(statistics.fmean(len(c) for c in comps), 2),
                 "solved_groups": sum(1 for g in range(args.prompts) if max(rewards[g * args.n:(g + 1) * args.n]) > 0),
                 "kept": len(keep)}
        # snapshot the policy that generation will use `staleness` steps from now
        if args.staleness:
            history.pop(0)
        if keep:
            seqs = [flat_prompts[i] + comps[i] for i in keep]
            plens = [len(flat_prompts[i]) for i in keep]
            A = torch.tensor([adv[i] for i in keep])
            width = max(len(s) for s in seqs) - 1
            behav = torch.zeros((len(keep), width))
            for j, i in enumerate(keep):
                behav[j, plens[j] - 1: plens[j] - 1 + len(blps[i])] = torch.tensor(blps[i])
            model.train()
            with torch.no_grad():
                prox, tmask = token_logprobs(model, seqs, plens, pad)
            iw = torch.exp(prox - behav).clamp(max=args.behav_cap) * tmask
            order = list(range(len(keep)))
            mb = max(1, len(keep) // args.minibatches)
            clipfrac_n = 0.0
            for _ in range(args.ppo_epochs):
                rng.shuffle(order)
                for s in range(0, len(order), mb):
                    idx = order[s: s + mb]
                    lp, m = token_logprobs(model, [seqs[i] for i in idx], [plens[i] for i in idx], pad)
                    w = lp.shape[1]
                    ratio = torch.exp(lp - prox[idx, :w])
                    a = A[idx, None]
                    surr = torch.minimum(ratio * a, ratio.clamp(1 - args.clip, 1 + args.clip) * a)
                    loss = -(surr * iw[idx, :w] * m).sum() / m.sum().clamp(min=1)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    sched.step()
                    clipfrac_n += float((((ratio - 1).abs() > args.clip).float() * m).sum() / m.sum())
            stats["clipfrac"] = round(clipfrac_n / (args.ppo_epochs * ((len(order) + mb - 1) // mb)), 4)
        model.eval()
        if args.staleness:
            history.append(copy.deepcopy(model).eval())
        train_s = time.perf_counter() - tt
        gen_total += gen_s + reward_s
        train_total += train_s
        wall += max(gen_s + reward_s, train_s)
        rec = {"phase": "rl", "step": step, **stats, "gen_s": round(gen_s, 3), "reward_s": round(reward_s, 3),
               "train_s": round(train_s, 3), "overlap_wall_s": round(wall, 2)}
        if step % args.eval_every == 0 or step == args.steps:
            acc = bm.greedy_accuracy(model, tok, eval_tasks)
            curve.append((step, acc))
            rec["heldout_acc"] = acc
            rec["gain"] = round(acc - acc0, 3)
        log(rec)
    first = next((s for s, a in curve if a - acc0 >= 0.25), None)
    log({"phase": "summary", "seed": args.seed, "acc0": acc0, "acc_final": curve[-1][1],
         "gain": round(curve[-1][1] - acc0, 3), "best": max(a for _, a in curve), "first_step_gain_25": first,
         "gen_s_per_step": round(gen_total / args.steps, 3), "train_s_per_step": round(train_total / args.steps, 3),
         "overlap_wall_s": round(wall, 1), "curve": curve, "args": vars(args) | {"sft_cache": str(args.sft_cache)}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
