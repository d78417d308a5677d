"""The code and search example agents, run as users run them (subprocesses with only --base-url and the admin key),
against scripted policies that solve their tasks: the code agent's run_python calls go through the gateway to the
reward service's sandbox, the search agent's lookups through its BM25 index, and every exported (graded)
trajectory scores 1 with the reward service's Scorer, on the agent's last answer."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.reward.client import RewardClient
from services.reward.scoring import Scorer
from tests.gateway.harness import ADMIN, GatewayServer, RewardServer
from tests.gateway.policies import scripted_engine

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"
TOOL_RESULTS = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", flags=re.S)


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


STRING_BODIES = {r"s reversed": "s[::-1]", r"s in upper case": "s.upper()", r"s repeated (\d+) times": "s * {0}",
                 r"how many times '(\w)' occurs in s": "s.count('{0}')", r"the first (\d+) characters of s": "s[:{0}]",
                 r"s with every '(\w)' replaced by '(\w)'": "s.replace('{0}', '{1}')"}


def function_solver(prompt: str, forced: str = "") -> str:
    """Solves the code agent's generated tasks; tries the function with run_python once before answering."""
    linear = re.findall(r"f\(x\) that returns (-?\d+) \* x \+ (-?\d+)\.", prompt)
    if linear:
        a, b = linear[-1]
        program = f"def f(x):\n    return {a} * x + {b}\n"
    else:
        what = re.findall(r"g\(s\) that returns (.+?)\.\s*<\|im_end\|>", prompt)[-1]
        body = next(body.format(*m.groups()) for pattern, body in STRING_BODIES.items()
                    if (m := re.fullmatch(pattern, what)))
        program = f"def g(s):\n    return {body}\n"
    if not TOOL_RESULTS.search(prompt):
        return call("run_python", code=program + "print('ran')")
    assert "status: ok" in TOOL_RESULTS.findall(prompt)[-1], prompt[-500:]  # the sandbox ran it
    return f"Tested. Final answer:\n```python\n{program}```"


def search_solver(prompt: str, forced: str = "") -> str:
    """Looks the person up, then (a region question) the town, then answers in the agent's <answer> format."""
    kind, person = re.findall(r"(Where|In which region) was (.+?) born\?", prompt)[-1]
    results = TOOL_RESULTS.findall(prompt)
    if not results:
        return call("search", query=f"{person} born")
    town = re.search(rf"{person} was .*? born in (\w+)\.", results[0]).group(1)
    if kind == "Where":
        return f"<answer>{town}</answer>"
    if len(results) == 1:
        return call("search", query=town)
    region = re.search(rf"{town} is a town in the region of (\w+)\.", results[1]).group(1)
    return f"<answer>{region}</answer>"


@pytest.fixture(scope="module")
def reward_server():
    server = RewardServer().start()
    yield server
    server.stop()


def run_agent(gw, script: str, *extra: str) -> list[dict]:
    out = subprocess.run([sys.executable, str(EXAMPLES / script), "--base-url", gw.url, "--admin-key", ADMIN, *extra],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize(("script", "solver", "verifier", "turns"), [
    ("code_agent.py", function_solver, "code_tests", {2}),
    ("search_agent.py", search_solver, "exact", {2, 3}),
])
def test_graded_example_agent_solves_its_tasks(tok, reward_server, script, solver, verifier, turns):
    gw = GatewayServer(scripted_engine(tok, solver), tok, reward=RewardClient(reward_server.address)).start()
    try:
        episodes = run_agent(gw, script, "--episodes", "8", "--group-size", "2", "--parallel", "4",
                             "--max-turns", "4", "--max-tokens", "160")
    finally:
        gw.stop()
    assert len(episodes) == 8 and {e["graded_by"] for e in episodes} == {verifier}
    assert {e["turns"] for e in episodes} <= turns and all(e["tool_calls"] == e["turns"] - 1 for e in episodes)
    assert "reward" not in episodes[0]  # the agent reports none: its verifier grades the episode
    trajs = gw.published
    assert len(trajs) == 8 and not any(t.scored for t in trajs) and {t.verifier for t in trajs} == {verifier}
    scorer = Scorer(lambda ids: tok.decode(ids, skip_special_tokens=True), "exact")
    assert [scorer.score(t).reward for t in trajs] == [1.0] * 8
