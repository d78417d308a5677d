"""Write a preference dataset for the built-in arithmetic task: each train row a prompt (``a+b=``), the right sum
as ``chosen`` and a near miss (the sum off by 1 to 10) as ``rejected``; beside it the eval split's prompts with
their answers. Deterministic per seed, from the arithmetic source's own splits (they never share a problem).

    python scripts/preference_data.py [--out artifacts/data] [--train 4000] [--eval 400] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random

from services.builder.datasets.arithmetic import generate_split


def rows(train: int, evals: int, seed: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(f"preferences/{seed}")
    pairs = []
    for task in generate_split("train", train, seed):
        right = int(task.answer)
        wrong = right + rng.choice([d for d in range(-10, 11) if d and right + d >= 0])
        pairs.append({"prompt": task.prompt, "chosen": task.answer, "rejected": str(wrong)})
    return pairs, [{"prompt": t.prompt, "answer": t.answer} for t in generate_split("eval", evals, seed)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="artifacts/data")
    ap.add_argument("--train", type=int, default=4000)
    ap.add_argument("--eval", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, split in zip(("arith-prefs.jsonl", "arith-eval.jsonl"), rows(a.train, a.eval, a.seed), strict=True):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in split))
        print(f"{out / name}: {len(split)} rows")


if __name__ == "__main__":
    main()
