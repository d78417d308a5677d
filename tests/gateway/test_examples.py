"""The example agents run end to end against a gateway (as subprocesses, with only --base-url and keys)."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from services.reward.client import RewardClient
from tests.gateway.harness import ADMIN, GatewayServer, RewardServer
from tests.gateway.policies import arithmetic_replies, demonstration_steps, scripted_engine

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"
sys.path[:0] = [str(EXAMPLES), str(EXAMPLES.parents[1] / "scripts")]
import code_agent  # noqa: E402  (examples/agents/code_agent.py)
import common  # noqa: E402  (examples/agents/common.py)
import search_agent  # noqa: E402
import tool_episodes  # noqa: E402  (scripts/tool_episodes.py)

AGENTS = ["openai_calculator_agent.py", "anthropic_calculator_agent.py"]
FRAMEWORK_AGENTS = ["langchain_agent.py", "camel_agent.py"]  # LangChain, CAMEL-AI: .venv-agents (make agents-env)
HAS_FRAMEWORKS = (EXAMPLES.parents[1] / ".venv-agents" / "bin" / "python").exists()


def run_agent(gw, script: str, *extra: str, env: dict[str, str] | None = None) -> list[dict]:
    out = subprocess.run([sys.executable, str(EXAMPLES / script), "--base-url", gw.url, "--admin-key", ADMIN, *extra],
                         capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def solver_gw(tok):
    server = GatewayServer(scripted_engine(tok, arithmetic_replies), tok).start()
    yield server
    server.stop()


@pytest.mark.parametrize("script", AGENTS)
def test_example_agent_calls_the_tool_and_earns_its_reward(solver_gw, script):
    """The temperature comes as the flag for one agent, as the launcher passes a run's (MESHRL_TEMPERATURE) for
    the other."""
    before = len(solver_gw.published)
    given = ((), {"MESHRL_TEMPERATURE": "0.7"}) if script.startswith("anthropic") else (("--temperature", "0.7"), {})
    episodes = run_agent(solver_gw, script, "--episodes", "4", "--group-size", "2", *given[0], env=given[1])
    assert [e["reward"] for e in episodes] == [1.0] * 4
    assert all(e["tool_calls"] == 1 and e["turns"] == 2 for e in episodes)
    trajs = solver_gw.published[before:]
    assert len(trajs) == 4 and {t.group_size for t in trajs} == {2} and len({t.group_id for t in trajs}) == 2
    assert {round(t.sampling.temperature, 6) for t in trajs} == {0.7}  # every turn sampled as --temperature asked
    assert all(t.reward == 1.0 and 0 in t.loss_mask for t in trajs)  # two turns: tool result tokens are masked


@pytest.mark.skipif(not HAS_FRAMEWORKS, reason="no .venv-agents: `make agents-env` (make test runs it)")
@pytest.mark.parametrize("script", FRAMEWORK_AGENTS)
def test_framework_agents_train_unchanged_but_for_base_url_and_key(solver_gw, script):
    """LangChain's and CAMEL's own agent loops (their tool calling, their message history sent back each turn)
    against the gateway: each episode is one trajectory (the second call extends the first's tokens), tool results
    masked, the reward the agent earned."""
    before = len(solver_gw.published)
    episodes = run_agent(solver_gw, script, "--episodes", "2", "--group-size", "2")
    assert [e["reward"] for e in episodes] == [1.0] * 2, episodes
    assert all(e["tool_calls"] == 1 and e["turns"] == 2 and e["trajectories"] == 1 for e in episodes), episodes
    trajs = solver_gw.published[before:]
    assert len(trajs) == 2 and {t.group_size for t in trajs} == {2}
    assert all(t.reward == 1.0 and 0 in t.loss_mask and 1 in t.loss_mask for t in trajs)


@pytest.mark.parametrize("script", AGENTS)
def test_example_agent_runs_on_a_random_policy_with_a_fixed_key(random_gw, script):
    episodes = run_agent(random_gw, script, "--episodes", "2", "--max-tokens", "16", "--api-key", f"fixed-{script}")
    assert len(episodes) == 2 and all(e["trajectories"] == 1 for e in episodes)


def calculator_tasks(rng: random.Random, n: int) -> dict:
    return {t[0]: (t[1], t[2]) for t in (common.task(rng) for _ in range(n))}


def code_tasks(rng: random.Random, n: int) -> dict:
    return {t.id: (t.question, t) for t in (code_agent.function_task(rng) for _ in range(n))}


def search_tasks(rng: random.Random, n: int) -> dict:
    return {q.id: (q.text, q.answer) for q in (rng.choice(search_agent.questions()) for _ in range(n))}


# script -> (scripts/tool_episodes.py's agent, the tasks the script draws from its --seed: id -> (question, expected))
WARM_STARTED = {"openai_calculator_agent.py": ("calculator", calculator_tasks),
                "anthropic_calculator_agent.py": ("calculator", calculator_tasks),
                "code_agent.py": ("code", code_tasks), "search_agent.py": ("search", search_tasks)}


def replay_demonstrations(agent: tool_episodes.Agent, tasks: dict):
    """A policy that writes the warm start's demonstration of each task."""
    step = demonstration_steps(agent, tasks.values())
    return lambda prompt, forced="": step(prompt).text


@pytest.fixture(scope="module")
def reward_server():
    server = RewardServer().start()
    yield server
    server.stop()


@pytest.mark.parametrize("script", sorted(WARM_STARTED))
def test_tool_warm_start_teaches_the_tokens_the_gateway_records(tok, reward_server, script):
    """The SFT demonstrations of `bootstrap_model.py --agent` are token for token the trajectories the gateway
    exports for the same episode, loss mask included (the code agent's run_python output from the reward service's
    sandbox, the search agent's BM25 results): what the warm start teaches is what RL then trains."""
    name, draw = WARM_STARTED[script]
    agent = tool_episodes.AGENTS[name]
    tasks = draw(random.Random(7), 3)  # the agent's --seed 7: the same three tasks, one a group
    server = GatewayServer(scripted_engine(tok, replay_demonstrations(agent, tasks)), tok,
                           reward=RewardClient(reward_server.address)).start()
    try:
        episodes = run_agent(server, script, "--episodes", "3", "--group-size", "1", "--parallel", "3",
                             "--max-tokens", "160", "--max-turns", "4", "--seed", "7")
        assert [e["turns"] for e in episodes] == [len(agent.steps(*tasks[e["task_id"]])) for e in episodes]
        assert all(e.get("reward", 1.0) == 1.0 for e in episodes)  # the calculator's own; the others are graded
        assert len(server.published) == 3
        for traj in server.published:
            ids, labels = tool_episodes.demonstration(tok, agent, *tasks[traj.task_id])
            assert list(traj.prompt_ids) + list(traj.completion_ids) == ids
            assert [0] * len(traj.prompt_ids) + list(traj.loss_mask) == [int(x != -100) for x in labels]
    finally:
        server.stop()


def test_an_agent_finds_a_generated_admin_key_without_being_given_one(tok, tmp_path, monkeypatch):
    """No MESHRL_ADMIN_KEY: the gateway generates its key into the run directory (0600) and names the file in its
    discovery note; the agent, given only --base-url, reads it from there. The old public key gets 401."""
    for name in ("MESHRL_ADMIN_KEY", "MESHRL_ADMIN_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MESHRL_RUNTIME_DIR", str(tmp_path / "runtime"))
    server = GatewayServer(scripted_engine(tok, arithmetic_replies), tok, admin_key="", run_dir=tmp_path / "run").start()
    try:
        key_file = tmp_path / "run" / "secrets" / "gateway_admin_key"
        assert key_file.stat().st_mode & 0o777 == 0o600 and server.config.admin_key == key_file.read_text().strip()
        r = httpx.post(server.url + "/rl/start_session", json={"task_id": "t"},
                       headers={"Authorization": "Bearer meshrl-dev-admin-key"}, timeout=10)
        assert r.status_code == 401
        out = subprocess.run([sys.executable, str(EXAMPLES / AGENTS[0]), "--base-url", server.url, "--episodes", "2",
                              "--group-size", "2"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert len([line for line in out.stdout.splitlines() if line.startswith("{")]) == 2
        assert server.config.admin_key not in out.stdout + out.stderr
    finally:
        server.stop()
    assert not list((tmp_path / "runtime").glob("gateway-*.json"))  # the note goes with the gateway


def test_the_stand_alone_dev_gateway_serves_an_example_agent_and_prints_its_trajectories(tmp_path):
    """examples/agents/dev_gateway.py (a tiny random policy, nothing trained): an agent's episodes end as printed
    trajectory lines, one per session of the group, with their token counts."""
    from services.common.net import free_port

    port = free_port()
    gateway = subprocess.Popen([sys.executable, str(EXAMPLES / "dev_gateway.py"), "--port", str(port),
                                "--run-dir", str(tmp_path / "run")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert gateway.poll() is None, gateway.stdout.read()[-3000:]
            __import__("time").sleep(0.1)
        out = subprocess.run([sys.executable, str(EXAMPLES / AGENTS[0]), "--base-url", url, "--episodes", "2",
                              "--group-size", "2", "--admin-key-file",
                              str(tmp_path / "run" / "secrets" / "gateway_admin_key")],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
    finally:
        gateway.terminate()
        printed, _ = gateway.communicate(timeout=60)
    lines = [json.loads(line) for line in printed.splitlines() if line.startswith('{"trajectory_id"')]
    assert len(lines) == 2 and all(line["completion_tokens"] > 0 and line["prompt_tokens"] > 0 for line in lines), \
        printed[-3000:]
    assert "gateway_publish_failed" not in printed


def test_temperature_is_refused_by_name_for_an_agent_that_cannot_send_it():
    def no_temperature(client, model, question, max_turns, max_tokens, *, system, use_tools):
        raise AssertionError("never played")

    args = argparse.Namespace(seed=0, task="calculator", temperature=0.7, episodes=1, parallel=1)
    with pytest.raises(SystemExit, match=r"--temperature \(or MESHRL_TEMPERATURE.*\): .* does not set its model's "
                                         r"temperature"):
        common.play(args, lambda key: key, no_temperature)
