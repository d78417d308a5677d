"""The example agents' warm-start episodes and held-out evaluation (scripts/tool_episodes.py): demonstrations are
what the agents' tools and graders really give, train and held-out tasks never meet, and the multi-turn greedy
evaluation scores a policy that replays the demonstrations as solved and a wrong one as not."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import tool_episodes  # noqa: E402

from services.trainer.models import build_tokenizer  # noqa: E402
from tests.gateway.policies import demonstration_steps  # noqa: E402

AGENTS = sorted(tool_episodes.AGENTS)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("name", AGENTS)
def test_demonstrations_hold_what_the_tools_and_grader_give(tok, name):
    agent = tool_episodes.AGENTS[name]
    end = tok.convert_tokens_to_ids(tool_episodes.IM_END)
    for _, question, expected in agent.split("train", 4, seed=0):
        steps = agent.steps(question, expected)
        assert steps[-1].tool is None and all(s.tool in agent.tool_names for s in steps[:-1]) and len(steps) > 1
        for step in steps[:-1]:  # the result the episode teaches is the tool's real answer (the sandbox's, for code)
            name_, args = tool_episodes.parse_call(agent, step.text)
            assert agent.run_tool(name_, args) == step.result
        assert agent.solved(steps[-1].text, expected)
        ids, labels = tool_episodes.demonstration(tok, agent, question, expected)
        taught = [i for i, label in zip(ids, labels, strict=True) if label != -100]
        # every reply and its end of turn, nothing of the prompt or the tools' results
        assert taught == [i for s in steps for i in [*tok.encode(s.text, add_special_tokens=False), end]]


def test_held_out_tasks_are_never_trained_on():
    import code_agent
    import search_agent

    for name in ("code", "search"):
        agent = tool_episodes.AGENTS[name]
        train = {t[0] for t in agent.split("train", 400, seed=0)}
        held = {t[0] for t in agent.split("eval", 200, seed=0)}
        assert train and held and not train & held, name
    code = tool_episodes.AGENTS["code"]  # held-out code tasks combine values each trained in its place

    def places(tasks):  # {(kind, place, value)}
        out = set()
        for task_id, *_ in tasks:
            linear = re.fullmatch(r"linear-(-?\d+)-(-?\d+)", task_id)
            kind, values = ("linear", linear.groups()) if linear else ("replace", task_id.removeprefix("string-replace-"))
            out |= {(kind, i, v) for i, v in enumerate(values)}
        return out
    held_code = code.split("eval", 200, seed=0)
    assert all(t[0].startswith(("linear-", "string-replace-")) for t in held_code)
    assert places(held_code) <= places(code.split("train", 3000, seed=0))
    rng = random.Random(7)  # what the agents themselves ask in training
    assert not any(code_agent.held_out(code_agent.generated_task(rng)[0]) for _ in range(300))
    held_people = {q.id for q in search_agent.questions(held_out=True)}
    assert not {search_agent.question_task(rng)[0] for _ in range(300)} & held_people


class Replay:
    """A policy for greedy_success's `generate`: replies with the demonstration's next step for the prompt's task,
    or with a wrong final answer."""

    def __init__(self, tok, agent, tasks, *, wrong_answer: bool = False):
        self.tok, self.wrong = tok, wrong_answer
        self.step = demonstration_steps(agent, [(question, expected) for _, question, expected in tasks])

    def __call__(self, model, tokenizer, prompts, max_new_tokens):
        end = self.tok.convert_tokens_to_ids(tool_episodes.IM_END)
        out = []
        for prompt in prompts:
            step = self.step(self.tok.decode(prompt))
            reply = "<answer>nobody</answer>```python\ndef f(x):\n    return 0\n```Answer: 0.5" \
                if self.wrong and step.tool is None else step.text
            out.append(self.tok.encode(reply, add_special_tokens=False)[:max_new_tokens] + [end])
        return out, [[0.0] * len(ids) for ids in out]


@pytest.mark.parametrize("name", AGENTS)
def test_greedy_evaluation_plays_every_turn_and_grades_the_last(tok, name):
    agent = tool_episodes.AGENTS[name]
    tasks = agent.split("eval", 6, seed=0)
    model = torch.nn.Linear(1, 1)
    assert tool_episodes.greedy_success(model, tok, agent, tasks, Replay(tok, agent, tasks)) == 1.0
    assert tool_episodes.greedy_success(model, tok, agent, tasks, Replay(tok, agent, tasks, wrong_answer=True)) == 0.0


def test_a_reply_that_calls_no_tool_is_graded_as_the_answer(tok):
    agent = tool_episodes.AGENTS["code"]
    tasks = agent.split("eval", 3, seed=0)

    def answer_at_once(model, tokenizer, prompts, max_new_tokens):
        replies = [f"```python\n{tasks[i][2].solution}```" for i in range(len(prompts))]
        return [tok.encode(r, add_special_tokens=False) for r in replies], [[] for _ in replies]

    assert tool_episodes.greedy_success(torch.nn.Linear(1, 1), tok, agent, tasks, answer_at_once) == 1.0
    calc = tool_episodes.AGENTS["calculator"]  # the calculator must call its tool first
    calc_tasks = calc.split("eval", 2, seed=0)
    answers = [json.dumps(t[2]) for t in calc_tasks]
    assert tool_episodes.greedy_success(
        torch.nn.Linear(1, 1), tok, calc, calc_tasks,
        lambda m, t, prompts, n: ([tok.encode(f"Answer: {a}", add_special_tokens=False) for a in answers],
                                  [[] for _ in answers])) == 0.0
