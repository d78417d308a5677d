"""The example agents run end to end against a gateway (as subprocesses, with only --base-url and keys)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gateway.harness import ADMIN, GatewayServer
from tests.gateway.policies import arithmetic_replies, scripted_engine

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"
AGENTS = ["openai_calculator_agent.py", "anthropic_calculator_agent.py"]


def run_agent(gw, script: str, *extra: str) -> list[dict]:
    out = subprocess.run([sys.executable, str(EXAMPLES / script), "--base-url", gw.url, "--admin-key", ADMIN, *extra],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def solver_gw(tok):
    server = GatewayServer(scripted_engine(tok, arithmetic_replies), tok).start()
    yield server
    server.stop()


@pytest.mark.parametrize("script", AGENTS)
def test_example_agent_calls_the_tool_and_earns_its_reward(solver_gw, script):
    before = len(solver_gw.published)
    episodes = run_agent(solver_gw, script, "--episodes", "4", "--group-size", "2")
    assert [e["reward"] for e in episodes] == [1.0] * 4
    assert all(e["tool_calls"] == 1 and e["turns"] == 2 for e in episodes)
    trajs = solver_gw.published[before:]
    assert len(trajs) == 4 and {t.group_size for t in trajs} == {2} and len({t.group_id for t in trajs}) == 2
    assert all(t.reward == 1.0 and 0 in t.loss_mask for t in trajs)  # two turns: tool result tokens are masked


@pytest.mark.parametrize("script", AGENTS)
def test_example_agent_runs_on_a_random_policy_with_a_fixed_key(random_gw, script):
    episodes = run_agent(random_gw, script, "--episodes", "2", "--max-tokens", "16", "--api-key", f"fixed-{script}")
    assert len(episodes) == 2 and all(e["trajectories"] == 1 for e in episodes)
