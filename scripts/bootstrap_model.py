"""Build the tiny Qwen3 model + character tokenizer, SFT-warm-start it, save a Hugging Face directory.

    python scripts/bootstrap_model.py --out artifacts/models/tiny-add --seed 0
    python scripts/bootstrap_model.py --out artifacts/models/tiny-tools --tools --band 0.3 0.5 --eval-every 25
    python scripts/bootstrap_model.py --out artifacts/models/tiny-code --agent code --band 0.3 0.5

SFT trains on demonstrations from the train split (loss on completion tokens + the end of turn only) and
stops as soon as greedy accuracy on the held-out split reaches the band's lower end (default 15%), so RL
starts from a model that is partly right. The curriculum is integer addition (raw text, or through the
chat template with --chat) or, with --agent, an example agent's multi-turn tool-using episodes
(scripts/tool_episodes.py: `calculator`, which --tools names too, `code` or `search`). Prints one JSON
line: held-out accuracy, steps, seconds. Deterministic per seed (CPU, fixed thread count).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from services.builder.datasets import Task, demonstration, extract_answer, generate_split  # noqa: E402
from services.trainer.models import TinyQwen3Config, build_tokenizer, padded_vocab_size  # noqa: E402
from services.trainer.models.tiny_vlm import TinyVLMConfig, build_vlm_tokenizer  # noqa: E402

# Defaults found with scripts/rl_feasibility.py (see its docstring).
MODEL = TinyQwen3Config(num_hidden_layers=2)
SFT_LR = 3e-3
SFT_BATCH = 64
SFT_MAX_STEPS = 3000
SFT_EVAL_EVERY = 10
SFT_WARMUP = 20
BAND = (0.15, 0.30)
EVAL_NUM = 200
EVAL_SEED = 0
TRAIN_NUM = 8_000


def is_correct(completion: str, reference: str) -> bool:
    """The reward service's check: math_verify on the extracted answer (fast path for plain integers)."""
    extracted = extract_answer(completion)
    if extracted is None:
        return False
    if extracted.lstrip("-").isdigit() and reference.lstrip("-").isdigit():
        return int(extracted) == int(reference)
    import math_verify

    return bool(math_verify.verify(math_verify.parse(reference), math_verify.parse(extracted)))


# "raw": the prompt is the problem text ("12+30="), the completion ends with EOS (the main job).
# "chat": the problem is a user message rendered with the chat template and the completion ends with the
# template's end of turn, so the model answers through the agent gateway.
# "tools": an example agent's whole episodes through the chat template (make run-agent's, run-code-agent's...).
PROMPT_STYLE = "raw"


def encode_prompt(tokenizer, text: str) -> list[int]:
    if PROMPT_STYLE == "chat":
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                             add_generation_prompt=True, return_dict=False)
    return tokenizer.encode(text, add_special_tokens=False)


def end_of_completion(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|im_end|>") if PROMPT_STYLE != "raw" else tokenizer.eos_token_id


def encode_prompts(tokenizer, tasks: list[Task]) -> list[list[int]]:
    return [encode_prompt(tokenizer, t.prompt) for t in tasks]


def sft_batch(tokenizer, tasks: list[Task]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask, labels (-100 except completion tokens and EOS)."""
    examples = []
    for t in tasks:
        p = encode_prompt(tokenizer, t.prompt)
        c = tokenizer.encode(demonstration(t), add_special_tokens=False) + [end_of_completion(tokenizer)]
        examples.append((p + c, [-100] * len(p) + c))
    return pad_batch(tokenizer, examples)


def pad_batch(tokenizer, examples: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    eos = tokenizer.eos_token_id
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), eos, dtype=torch.long)
    lab = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (s, lb) in enumerate(examples):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(lb)] = torch.tensor(lb)
        mask[i, : len(s)] = 1
    return ids, mask, lab


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, generator: torch.Generator | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Batched sampling with a KV cache (left padding). Returns completion ids (EOS included when
    produced) and their log-probs under the sampling distribution at temperature 1 (behaviour log-probs)."""
    eos = tokenizer.eos_token_id
    b = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((b, width), eos, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    logits = out.logits[:, -1, :]
    next_pos = pos[:, -1:] + 1
    done = torch.zeros(b, dtype=torch.bool)
    comp: list[list[int]] = [[] for _ in range(b)]
    lps: list[list[float]] = [[] for _ in range(b)]
    for _ in range(max_new_tokens):
        logits = logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        if temperature <= 0:
            tok = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            if top_p < 1.0:
                sp, si = probs.sort(-1, descending=True)
                keep = sp.cumsum(-1) - sp < top_p
                sp = sp * keep
                probs = torch.zeros_like(probs).scatter(-1, si, sp)
            tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        tok_lp = logp.gather(-1, tok[:, None]).squeeze(-1)
        for i in range(b):
            if not done[i]:
                comp[i].append(int(tok[i]))
                lps[i].append(float(tok_lp[i]))
        done |= (tok == eos) | (tok == end_of_completion(tokenizer))
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long)], dim=-1)
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, cache=cache, use_cache=True)
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    return comp, lps


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, tasks: list[Task], max_new_tokens: int = 8, batch: int = 256) -> float:
    was_training = model.training
    model.eval()
    correct = 0
    for s in range(0, len(tasks), batch):
        chunk = tasks[s: s + batch]
        comps, _ = generate(model, tokenizer, encode_prompts(tokenizer, chunk), max_new_tokens)
        correct += sum(is_correct(decode(tokenizer, c), t.answer) for c, t in zip(comps, chunk, strict=False))
    model.train(was_training)
    return correct / max(len(tasks), 1)


def build(seed: int, cfg: TinyQwen3Config = MODEL):
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    model = cfg.build(padded_vocab_size(tokenizer), tokenizer.eos_token_id)
    return tokenizer, model


def sft(model, tokenizer, seed: int, lr: float = SFT_LR, batch: int = SFT_BATCH, max_steps: int = SFT_MAX_STEPS,
        eval_every: int = SFT_EVAL_EVERY, band: tuple[float, float] = BAND, eval_tasks: list[Task] | None = None,
        log=None, curriculum: Curriculum | None = None) -> dict:
    """SFT until held-out greedy accuracy is inside ``band`` (or above it, or max_steps). Returns a summary."""
    torch.manual_seed(seed)
    curriculum = curriculum or addition_curriculum(tokenizer, seed, eval_tasks)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / SFT_WARMUP))
    g = torch.Generator().manual_seed(seed)
    model.train()
    t0 = time.perf_counter()
    acc, step, loss_v = 0.0, 0, float("nan")
    history = []
    for step in range(1, max_steps + 1):
        idx = torch.randint(curriculum.train_size, (batch,), generator=g).tolist()
        loss = model(**curriculum.batch(idx)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_v = float(loss.detach())
        if step % eval_every == 0:
            acc = curriculum.evaluate(model)
            history.append((step, round(acc, 3)))
            if log:
                log({"phase": "sft", "step": step, "loss": round(loss_v, 4), "heldout_acc": acc,
                     "t": round(time.perf_counter() - t0, 2)})
            if acc >= band[0]:
                break
    model.eval()
    return {"sft_steps": step, "sft_loss": round(loss_v, 4), "heldout_acc": acc, "history": history,
            "sft_seconds": round(time.perf_counter() - t0, 2)}


@dataclasses.dataclass
class Curriculum:
    """What SFT trains on: a training-set size, a batch's model inputs (ids, mask, labels...) by index, a held-out
    score."""
    train_size: int
    batch: Callable[[list[int]], dict[str, torch.Tensor]]
    evaluate: Callable[[torch.nn.Module], float]


def addition_curriculum(tokenizer, seed: int, eval_tasks: list[Task] | None = None) -> Curriculum:
    train = generate_split("train", TRAIN_NUM, seed)
    eval_tasks = eval_tasks if eval_tasks is not None else generate_split("eval", EVAL_NUM, EVAL_SEED)
    return Curriculum(TRAIN_NUM, lambda idx: inputs(*sft_batch(tokenizer, [train[i] for i in idx])),
                      lambda model: greedy_accuracy(model, tokenizer, eval_tasks))


def tool_curriculum(tokenizer, seed: int, name: str) -> Curriculum:
    """An example agent's episodes: tool calls, the tools' results, the answer (scripts/tool_episodes.py)."""
    import tool_episodes

    agent = tool_episodes.AGENTS[name]
    train = agent.split("train", TRAIN_NUM, seed)
    eval_tasks = agent.split("eval", EVAL_NUM, seed)

    def batch(idx: list[int]) -> dict[str, torch.Tensor]:
        return inputs(*pad_batch(tokenizer, [tool_episodes.demonstration(tokenizer, agent, q, e)
                                             for _, q, e in (train[i] for i in idx)]))

    return Curriculum(TRAIN_NUM, batch,
                      lambda model: tool_episodes.greedy_success(model, tokenizer, agent, eval_tasks, generate))


def inputs(ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def vision_curriculum(processor, seed: int, size: int) -> Curriculum:
    """Counting shapes in pictures (scripts/vision_tasks.py) for the tiny LLaVA."""
    import vision_tasks

    train, eval_tasks = vision_tasks.splits(seed, TRAIN_NUM, EVAL_NUM, size)
    return Curriculum(TRAIN_NUM, lambda idx: vision_tasks.sft_inputs(processor, [train[i] for i in idx]),
                      lambda model: vision_tasks.greedy_accuracy(model, processor, eval_tasks, is_correct))


def save(model, tokenizer, out: Path) -> None:
    """The model and its tokenizer (or processor: tokenizer, image processor and processor config)."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("MESHRL_TORCH_THREADS", "2")))
    ap.add_argument("--band", type=float, nargs=2, default=BAND, metavar=("LO", "HI"))
    ap.add_argument("--max-steps", type=int, default=SFT_MAX_STEPS)
    ap.add_argument("--lr", type=float, default=SFT_LR)
    ap.add_argument("--verbose", action="store_true")
    style = ap.add_mutually_exclusive_group()
    style.add_argument("--chat", action="store_true", help="addition through the chat template")
    style.add_argument("--vision", action="store_true",
                       help="a tiny LLaVA (SigLIP vision tower + this Qwen3) counting shapes in drawn pictures")
    style.add_argument("--tools", action="store_const", dest="agent", const="calculator",
                       help="the calculator agent's tool-using episodes (examples/agents): --agent calculator")
    style.add_argument("--agent", choices=["calculator", "code", "search"],
                       help="an example agent's tool-using episodes (examples/agents) through the chat template")
    ap.add_argument("--layers", type=int, default=MODEL.num_hidden_layers)
    ap.add_argument("--experts", type=int, default=0, help="> 0: a Qwen3-MoE with this many top-2 experts a layer")
    ap.add_argument("--eval-every", type=int, default=SFT_EVAL_EVERY, help="SFT steps between held-out evaluations")
    args = ap.parse_args(argv)
    global PROMPT_STYLE
    PROMPT_STYLE = "tools" if args.agent else "chat" if args.chat else "raw"
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    text = dataclasses.replace(MODEL, num_hidden_layers=args.layers, num_experts=args.experts)
    log = (lambda rec: print(json.dumps(rec), file=sys.stderr, flush=True)) if args.verbose else None
    if args.vision:
        PROMPT_STYLE = "vision"
        torch.manual_seed(args.seed)
        vlm = TinyVLMConfig(text=text)
        tokenizer = build_vlm_tokenizer()
        model, processor = vlm.build(tokenizer), vlm.processor(tokenizer)
        curriculum = vision_curriculum(processor, args.seed, vlm.image_size)
    else:
        tokenizer, model = build(args.seed, text)
        processor, curriculum = tokenizer, tool_curriculum(tokenizer, args.seed, args.agent) if args.agent else None
    summary = sft(model, tokenizer, args.seed, lr=args.lr, max_steps=args.max_steps, band=tuple(args.band), log=log,
                  curriculum=curriculum, eval_every=args.eval_every)
    save(model, processor, args.out)
    print(json.dumps({
        "out": str(args.out), "seed": args.seed, "prompt_style": PROMPT_STYLE, "agent": args.agent,
        "heldout_acc": summary["heldout_acc"], "sft_steps": summary["sft_steps"], "sft_loss": summary["sft_loss"],
        "params": sum(p.numel() for p in model.parameters()), "vocab_size": model.get_output_embeddings().weight.shape[0],
        "seconds": round(time.perf_counter() - t0, 2),
    }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
