"""Held-out solved share of an example agent's model, outside the stack: greedy episodes on the agent's held-out
tasks, its tools run as in training (the code agent's in the reward service's sandbox) and its final replies graded
by its own verifier (scripts/tool_episodes.py, the same evaluation that stops the warm start).

    python scripts/eval_agent.py --agent code --model tiny-qwen3-code --model runs/code-agent-seed0/final

A model is a built-in name (the warm-started model for --seed) or a Hugging Face model directory. Prints one JSON
line per model.
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
sys.path.insert(0, str(ROOT / "scripts"))

import bootstrap_model  # noqa: E402
import tool_episodes  # noqa: E402

from launcher.stack import resolve_model  # noqa: E402


def evaluate(model_dir: pathlib.Path, agent: tool_episodes.Agent, tasks: list) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    started = time.time()
    solved = tool_episodes.greedy_success(model, tokenizer, agent, tasks, bootstrap_model.generate)
    return {"agent": agent.name, "model": str(model_dir), "heldout_episodes": len(tasks), "heldout_solved": solved,
            "seconds": round(time.time() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agent", required=True, choices=sorted(tool_episodes.AGENTS))
    parser.add_argument("--model", action="append", required=True, help="a built-in name or a model directory; "
                                                                         "repeat it to grade several")
    parser.add_argument("--seed", type=int, default=0, help="the built-in model's seed (the run's)")
    parser.add_argument("--num", type=int, default=bootstrap_model.EVAL_NUM, help="held-out episodes")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bootstrap_model.PROMPT_STYLE = "tools"  # its generate stops at the end of an assistant turn
    agent = tool_episodes.AGENTS[args.agent]
    tasks = agent.split("eval", args.num, args.seed)
    for model in args.model:
        print(json.dumps(evaluate(resolve_model(model, args.seed), agent, tasks)), flush=True)


if __name__ == "__main__":
    main()
