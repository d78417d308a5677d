"""Calculator-agent episodes as token sequences: SFT demonstrations and a greedy two-turn evaluation.

The token layout is the gateway's: turn 1 is the chat template's prompt (system, tools, user) and the
sampled tool call; turn 2 appends what the template renders after the assistant's end of turn (the tool
result as a user turn and the next generation prompt), then the answer. The task, tool and reward are the
example agents' own (examples/agents/common.py), so the warm start teaches exactly what they ask for.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "agents"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import SYSTEM, TOOLS, reward, run_tool, task  # noqa: E402

from services.rollout.gateway import toolcalls  # noqa: E402
from services.rollout.gateway.toolcalls import CLOSE, OPEN  # noqa: E402

IM_END = "<|im_end|>"
EVAL_SEED = 424242
HELD_OUT = 400


def split(name: str, num: int, seed: int) -> list[tuple[str, str, float]]:
    """``num`` distinct (task_id, question, expected) of ``name``; train never repeats one of the first
    HELD_OUT eval questions."""
    if name == "eval":
        return _draw(random.Random(f"calculator/eval/{EVAL_SEED}"), num)
    held_out = {t[0] for t in split("eval", HELD_OUT, seed)}
    return _draw(random.Random(f"calculator/train/{seed}"), num, exclude=held_out)


def _draw(rng: random.Random, num: int, exclude: frozenset | set = frozenset()) -> list[tuple[str, str, float]]:
    out, seen = [], set(exclude)
    while len(out) < num:
        t = task(rng)
        if t[0] not in seen:
            seen.add(t[0])
            out.append(t)
    return out


def expression(question: str) -> str:
    return question.removeprefix("What is ").removesuffix("?")


def tool_call_text(expr: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": ' + json.dumps({"expression": expr}) + "}</tool_call>"


def _messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def first_prompt(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template(_messages(question), tools=TOOLS, tokenize=True, add_generation_prompt=True,
                                         return_dict=False)


def bridge(tokenizer, question: str, result: str) -> list[int]:
    """The ids after the assistant's end of turn: the tool result and the next generation prompt."""
    call = {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
    before = tokenizer.apply_chat_template(_messages(question), tools=TOOLS, tokenize=False, add_generation_prompt=True)
    after = tokenizer.apply_chat_template(
        [*_messages(question), {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "c", "content": result}],
        tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert after.startswith(before)
    rest = after[after.index(IM_END, len(before)) + len(IM_END):]
    return tokenizer.encode(rest, add_special_tokens=False)


def demonstration(tokenizer, question: str, expected: float) -> tuple[list[int], list[int]]:
    """(ids, labels) of a whole correct episode; labels are -100 except the two assistant turns."""
    end = tokenizer.convert_tokens_to_ids(IM_END)
    result = run_tool("calculator", {"expression": expression(question)})
    p1 = first_prompt(tokenizer, question)
    c1 = tokenizer.encode(tool_call_text(expression(question)), add_special_tokens=False) + [end]
    b = bridge(tokenizer, question, result)
    c2 = tokenizer.encode(f"Answer: {result}", add_special_tokens=False) + [end]
    ids = p1 + c1 + b + c2
    labels = [-100] * len(p1) + c1 + [-100] * len(b) + c2
    return ids, labels


def parse_call(text: str) -> dict | str | None:
    """The arguments of the first calculator call in ``text``, read as the gateway reads tool calls."""
    start, stop = text.find(OPEN), text.find(CLOSE)
    if start < 0 or stop < start:
        return None
    call = toolcalls.parse_call(text[start + len(OPEN): stop], lambda: "eval")
    return call.arguments_value() if call is not None and call.name == "calculator" else None


@torch.no_grad()
def greedy_success(model, tokenizer, tasks: list[tuple[str, str, float]], generate, batch: int = 128) -> float:
    """Fraction of episodes (tool call, tool result, answer) that end with the right answer."""
    was_training = model.training
    model.eval()
    wins = 0
    end = tokenizer.convert_tokens_to_ids(IM_END)
    for s in range(0, len(tasks), batch):
        chunk = tasks[s: s + batch]
        p1 = [first_prompt(tokenizer, q) for _, q, _ in chunk]
        c1, _ = generate(model, tokenizer, p1, 96)
        second, idx = [], []
        for i, ((_, question, _), ids) in enumerate(zip(chunk, c1, strict=True)):
            args = parse_call(tokenizer.decode(ids, skip_special_tokens=True))
            if args is None:
                continue
            result = run_tool("calculator", args)
            closed = ids if ids and ids[-1] == end else [*ids, end]  # the gateway closes a cut-off turn the same way
            second.append(p1[i] + closed + bridge(tokenizer, question, result))
            idx.append(i)
        if second:
            c2, _ = generate(model, tokenizer, second, 16)
            wins += sum(reward(tokenizer.decode(ids, skip_special_tokens=True), chunk[i][2]) == 1.0
                        for i, ids in zip(idx, c2, strict=True))
    model.train(was_training)
    return wins / max(len(tasks), 1)
