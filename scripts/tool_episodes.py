"""The example agents' episodes as token sequences: SFT demonstrations and a greedy multi-turn evaluation.

Three agents (examples/agents): the calculator (`make run-agent`), the code agent with its sandboxed `run_python`
tool (`make run-code-agent`) and the search agent with its BM25 `search` tool (`make run-search-agent`). Their
tasks, tools and grading are the agents' own, so a warm start teaches exactly what they ask for and the evaluation
grades as their training does (the code and search episodes by the reward service's verifiers).

The token layout is the gateway's: the first turn is the chat template's prompt (system, tools, user) and the
sampled reply; each tool call is followed by what the template renders after the assistant's end of turn (the
tool result as a user turn and the next generation prompt), then the next reply.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "agents"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import code_agent  # noqa: E402
import common  # noqa: E402
import search_agent  # noqa: E402

from services.reward import sandbox  # noqa: E402
from services.reward.verifiers import build_verifier  # noqa: E402
from services.rollout.gateway import toolcalls  # noqa: E402
from services.rollout.gateway.toolcalls import CLOSE, OPEN  # noqa: E402

IM_END = "<|im_end|>"
EVAL_SEED = 424242
HELD_OUT = 400


@dataclasses.dataclass(frozen=True)
class Step:
    """One assistant turn of a correct episode: a tool call (and the tool's result) or the final answer."""
    text: str
    tool: str | None = None
    result: str = ""


@dataclasses.dataclass(frozen=True)
class Agent:
    name: str
    system: str
    tools: list[dict]
    split: Callable[[str, int, int], list[tuple[str, str, Any]]]  # (split, num, seed) -> (task id, question, expected)
    steps: Callable[[str, Any], list[Step]]                        # a correct episode for (question, expected)
    run_tool: Callable[[str, dict | str], str]
    solved: Callable[[str, Any], bool]                            # (final reply, expected)
    turn_tokens: tuple[int, ...]                                  # new tokens per turn; its length caps the turns
    tool_first: bool = False                                      # a first reply without a tool call fails

    @property
    def tool_names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}


def call_text(name: str, arguments: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


# --- the calculator agent (examples/agents/common.py) ---

def calculator_split(name: str, num: int, seed: int) -> list[tuple[str, str, float]]:
    """``num`` distinct (task_id, question, expected); train never repeats one of the first HELD_OUT eval questions."""
    if name == "eval":
        return _distinct(random.Random(f"calculator/eval/{EVAL_SEED}"), num)
    held_out = {t[0] for t in calculator_split("eval", HELD_OUT, seed)}
    return _distinct(random.Random(f"calculator/train/{seed}"), num, exclude=held_out)


def _distinct(rng: random.Random, num: int, exclude: frozenset | set = frozenset()) -> list[tuple[str, str, float]]:
    out, seen = [], set(exclude)
    while len(out) < num:
        t = common.task(rng)
        if t[0] not in seen:
            seen.add(t[0])
            out.append(t)
    return out


def expression(question: str) -> str:
    return question.removeprefix("What is ").removesuffix("?")


def calculator_steps(question: str, expected: float) -> list[Step]:
    result = common.run_tool("calculator", {"expression": expression(question)})
    return [Step(call_text("calculator", {"expression": expression(question)}), "calculator", result),
            Step(f"Answer: {result}")]


CALCULATOR = Agent("calculator", common.SYSTEM, common.TOOLS, calculator_split, calculator_steps, common.run_tool,
                   lambda reply, expected: common.reward(reply, expected) == 1.0, (96, 16), tool_first=True)


# --- the code agent (examples/agents/code_agent.py): try the function once with run_python, then answer ---

def code_split(name: str, num: int, seed: int) -> list[tuple[str, str, Any]]:
    """Held-out tasks (`code_agent.held_out`) for eval, the others for train: (id, question, FunctionTask)."""
    rng = random.Random(f"code/{name}/{EVAL_SEED if name == 'eval' else seed}")
    tasks = [code_agent.function_task(rng, heldout=name == "eval") for _ in range(num)]
    return [(t.id, t.question, t) for t in tasks]


def code_steps(question: str, task) -> list[Step]:
    example = 2 if task.entry == "f" else "abcab"
    printed = f"{task.reference(example)}\n"
    return [Step(call_text("run_python", {"code": f"{task.solution}print({task.entry}({example!r}))"}), "run_python",
                 code_agent.tool_output("ok", 0, printed, "")),
            Step(f"```python\n{task.solution}```")]


def run_python(name: str, args: dict | str) -> str:
    """The code agent's tool, in the reward service's sandbox (the one /rl/run_code uses)."""
    code = args.get("code") if isinstance(args, dict) else None
    if name != "run_python" or not isinstance(code, str) or not code:
        return f"error: call run_python with a 'code' string (got {name!r})"
    run = sandbox.shared_sandbox().run(code)
    return code_agent.tool_output(run.status, run.exit_code, run.stdout, run.stderr)


@functools.cache
def _verifier(name: str):
    return build_verifier(name)


def code_solved(reply: str, task) -> bool:
    return _verifier("code_tests").score(reply, task.as_task()[2]).reward == 1.0


CODE = Agent("code", code_agent.SYSTEM, code_agent.TOOLS, code_split, code_steps, run_python, code_solved,
             (160, 128, 128))


# --- the search agent (examples/agents/search_agent.py): look the person up, then the town, then answer ---

def search_split(name: str, num: int, seed: int) -> list[tuple[str, str, Any]]:
    """Questions about held-out people for eval, about the others for train: (id, question, answer)."""
    rng = random.Random(f"search/{name}/{EVAL_SEED if name == 'eval' else seed}")
    pool = search_agent.questions(held_out=name == "eval")
    return [(q.id, q.text, q.answer) for q in (rng.choice(pool) for _ in range(num))]


def search_steps(question: str, answer: str) -> list[Step]:
    kind, person = re.fullmatch(r"(Where|In which region) was (.+) born\?", question).groups()
    found = search_agent.search(person)
    steps = [Step(call_text("search", {"query": person}), "search", found)]
    if kind != "Where":
        town = re.search(rf"{person} was .*? born in (\w+)\.", found)[1]
        steps.append(Step(call_text("search", {"query": town}), "search", search_agent.search(town)))
    return [*steps, Step(f"<answer>{answer}</answer>")]


def search_solved(reply: str, answer: str) -> bool:
    return _verifier("exact").score(reply, search_agent.grading(answer)).reward == 1.0


SEARCH = Agent("search", search_agent.SYSTEM, search_agent.TOOLS, search_split, search_steps, search_agent.run_tool,
               search_solved, (96, 96, 96, 32))


AGENTS = {a.name: a for a in (CALCULATOR, CODE, SEARCH)}


# --- token sequences ---

def _messages(agent: Agent, question: str) -> list[dict]:
    return [{"role": "system", "content": agent.system}, {"role": "user", "content": question}]


def first_prompt(tokenizer, agent: Agent, question: str) -> list[int]:
    return tokenizer.apply_chat_template(_messages(agent, question), tools=agent.tools, tokenize=True,
                                         add_generation_prompt=True, return_dict=False)


def bridge(tokenizer, agent: Agent, question: str, tool: str, result: str) -> list[int]:
    """The ids after the assistant's end of turn: the tool result and the next generation prompt (the template
    renders them the same whatever came before)."""
    call = {"id": "c", "type": "function", "function": {"name": tool, "arguments": "{}"}}
    before = tokenizer.apply_chat_template(_messages(agent, question), tools=agent.tools, tokenize=False,
                                           add_generation_prompt=True)
    after = tokenizer.apply_chat_template(
        [*_messages(agent, question), {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "c", "content": result}],
        tools=agent.tools, tokenize=False, add_generation_prompt=True)
    assert after.startswith(before)
    rest = after[after.index(IM_END, len(before)) + len(IM_END):]
    return tokenizer.encode(rest, add_special_tokens=False)


def demonstration(tokenizer, agent: Agent, question: str, expected: Any) -> tuple[list[int], list[int]]:
    """(ids, labels) of a whole correct episode; labels are -100 except the assistant's turns."""
    end = tokenizer.convert_tokens_to_ids(IM_END)
    ids = first_prompt(tokenizer, agent, question)
    labels = [-100] * len(ids)
    for step in agent.steps(question, expected):
        reply = tokenizer.encode(step.text, add_special_tokens=False) + [end]
        ids, labels = ids + reply, labels + reply
        if step.tool is not None:
            after = bridge(tokenizer, agent, question, step.tool, step.result)
            ids, labels = ids + after, labels + [-100] * len(after)
    return ids, labels


def parse_call(agent: Agent, text: str) -> tuple[str, dict | str] | None:
    """(name, arguments) of the first call to one of the agent's tools in ``text``, read as the gateway reads it."""
    start, stop = text.find(OPEN), text.find(CLOSE)
    if start < 0 or stop < start:
        return None
    call = toolcalls.parse_call(text[start + len(OPEN): stop], lambda: "eval")
    return (call.name, call.arguments_value()) if call is not None and call.name in agent.tool_names else None


@torch.no_grad()
def greedy_success(model, tokenizer, agent: Agent, tasks: list[tuple[str, str, Any]], generate,
                   batch: int = 128) -> float:
    """Fraction of episodes whose final reply is right: greedy turns, each tool call run and its result sent back,
    until a reply calls no tool or the turns run out (the last turn's reply is graded as it is)."""
    was_training = model.training
    model.eval()
    wins = 0
    end = tokenizer.convert_tokens_to_ids(IM_END)
    for s in range(0, len(tasks), batch):
        chunk = tasks[s: s + batch]
        rows = {i: first_prompt(tokenizer, agent, q) for i, (_, q, _) in enumerate(chunk)}
        for turn, max_new in enumerate(agent.turn_tokens):
            active = sorted(rows)
            if not active:
                break
            replies, _ = generate(model, tokenizer, [rows[i] for i in active], max_new)
            for i, ids in zip(active, replies, strict=True):
                text = tokenizer.decode(ids, skip_special_tokens=True)
                call = parse_call(agent, text)
                last = turn == len(agent.turn_tokens) - 1
                if call is None or last:
                    del rows[i]
                    wins += not (call is None and turn == 0 and agent.tool_first) and agent.solved(text, chunk[i][2])
                    continue
                # the gateway closes a cut-off turn the same way
                closed = ids if ids and ids[-1] == end else [*ids, end]
                rows[i] = rows[i] + closed + bridge(tokenizer, agent, chunk[i][1], call[0], agent.run_tool(*call))
    model.train(was_training)
    return wins / max(len(tasks), 1)
