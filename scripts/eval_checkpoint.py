"""Held-out accuracy of a Hugging Face model directory on a run config's eval split, outside the stack:

    python scripts/eval_checkpoint.py --model runs/smollm2/final --config configs/smollm2.yaml
    python scripts/eval_checkpoint.py --config configs/smollm2.yaml          # the config's starting model

The eval split, its rendering and its grading are the run's own: the builder's dataset section and seed
(`services.builder.datasets`), greedy decoding up to the builder's `eval_max_new_tokens`, the reward
service's verifiers; a reply counts as right when its reward is > 0 (the builder's eval accuracy).
Loads with `AutoModelForCausalLM.from_pretrained`. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launcher.runconfig import RunConfig  # noqa: E402
from launcher.stack import resolve_model  # noqa: E402
from services.builder.config import BuilderConfig  # noqa: E402
from services.builder.tasks import grading_of  # noqa: E402
from services.common import grading  # noqa: E402
from services.reward.verifiers import build_verifier  # noqa: E402


def builder_config(run: RunConfig, seed: int) -> BuilderConfig:
    """The builder's config as `meshrl run` derives it from the same file (its held-out split, its seed)."""
    return run.derive(seed=seed).builder


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int, batch: int,
             temperature: float = 0.0) -> list[str]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    for start in range(0, len(prompts), batch):
        rows = prompts[start:start + batch]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=temperature > 0, temperature=temperature or None, top_p=1.0, top_k=0,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
        out += tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True)
    return out


def evaluate(model_dir: str, run: RunConfig, *, seed: int = 0, limit: int = 0, batch: int = 32,
             dtype: str = "float32", show: int = 0, temperature: float = 0.0) -> dict:
    config = builder_config(run, seed)
    data = config.dataset.build(seed=config.seed, train_size=1, eval_size=config.eval_size)
    tasks = data.eval[:limit] if limit else data.eval
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    encode = config.dataset.encoder(tokenizer)
    started = time.time()
    torch.manual_seed(seed)
    replies = generate(model, tokenizer, [encode(t) for t in tasks], max_new_tokens=config.eval_max_new_tokens,
                       batch=batch, temperature=temperature)
    verifiers: dict = {}
    right = 0
    for i, (task, reply) in enumerate(zip(tasks, replies, strict=True)):
        meta = grading.to_task(grading_of(task))  # what the reward service would get
        name = meta["verifier"]
        verifier = verifiers.get(name) or verifiers.setdefault(name, build_verifier(name))
        reward = verifier.score(reply, meta).reward
        right += reward > 0
        if i < show:
            print(json.dumps({"prompt": task.prompt, "answer": task.answer, "reply": reply, "reward": reward}),
                  file=sys.stderr)
    return {"model": str(model_dir), "eval_size": len(tasks), "accuracy": right / max(1, len(tasks)),
            "max_new_tokens": config.eval_max_new_tokens, "temperature": temperature, "dtype": dtype, "seconds": round(time.time() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the run config (its dataset and builder sections)")
    parser.add_argument("--model", default="", help="a model directory (default: the config's model)")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (the builder draws the eval split with it)")
    parser.add_argument("--limit", type=int, default=0, help="only the first N eval tasks")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the builder's eval); else sampled")
    parser.add_argument("--show", type=int, default=0, help="print the first N prompts and replies to stderr")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run = RunConfig.load(args.config, root=ROOT)
    model = args.model or str(resolve_model(run.model, args.seed))
    print(json.dumps(evaluate(model, run, seed=args.seed, limit=args.limit, batch=args.batch, dtype=args.dtype,
                              show=args.show, temperature=args.temperature)))


if __name__ == "__main__":
    main()
