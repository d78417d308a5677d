"""tau2-bench through meshrl, with tau2's own package (.venv-tau2, `make tau2-env`; make test builds it):

- the wiring into tau2's evaluation, without a model: on every task of the mock domain, tau2's orchestrator and
  evaluation give a scripted agent that performs the reference actions reward 1, and 0 with one argument wrong;
- a real pass: tau2's own LLMAgent (litellm) on a gateway, tau2's own UserSimulator on a frozen model that the
  launcher's FrozenModels serves (never trained: it refuses sessions), the episodes exported token-exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from launcher.frozen import FrozenModel, FrozenModels
from launcher.stack import resolve_model
from tests.gateway.harness import ADMIN, GatewayServer
from tests.gateway.policies import random_engine

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "examples" / "agents" / "tau2_agent.py"
TAU2_PYTHON = ROOT / ".venv-tau2" / "bin" / "python"
pytestmark = pytest.mark.skipif(not TAU2_PYTHON.exists(), reason="no .venv-tau2: `make tau2-env` (make test runs it)")


def lines(out: subprocess.CompletedProcess) -> list[dict]:
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_tau2s_own_evaluation_rewards_the_right_actions_and_not_wrong_ones():
    out = subprocess.run([sys.executable, str(AGENT), "--scripted-check", "--domain", "mock"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    checked = lines(out)
    assert len(checked) == 7, checked  # the mock tasks with an agent action to perform
    assert all(c["right"] == {"reward": 1.0, "termination": "user_stop"} for c in checked), checked
    spoilable = [c for c in checked if c["wrong"] is not None]
    assert len(spoilable) == 6 and all(c["wrong"]["reward"] == 0.0 for c in spoilable), checked


@pytest.fixture(scope="module")
def user_simulator(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("frozen")
    (run_dir / "logs").mkdir()
    model = FrozenModel(model="tiny-qwen3", max_context=8192, max_tokens_cap=32)
    frozen = FrozenModels({"user_simulator": model}, {"user_simulator": resolve_model("tiny-qwen3", 0)}, run_dir)
    frozen.start(timeout=120)
    yield frozen
    assert frozen.stop() == {"user_simulator": 0}, (run_dir / "logs" / "frozen-user_simulator.log").read_text()[-2000:]


def test_the_frozen_model_answers_its_admin_key_and_refuses_sessions(user_simulator):
    env = user_simulator.env()
    key = Path(env["MESHRL_FROZEN_USER_SIMULATOR_KEY_FILE"]).read_text().strip()

    def post(path: str, body: dict) -> tuple[int, dict]:
        request = urllib.request.Request(env["MESHRL_FROZEN_USER_SIMULATOR_URL"].removesuffix("/v1") + path,
                                         data=json.dumps(body).encode(), method="POST",
                                         headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    status, reply = post("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 200})
    assert status == 200 and reply["usage"]["completion_tokens"] <= 32  # its max_tokens_cap
    status, reply = post("/rl/start_session", {"task_id": "t"})
    assert status == 403 and "frozen" in reply["error"]["message"]


def test_tau2_episodes_train_through_the_gateway_with_a_served_user(tok, user_simulator):
    gw = GatewayServer(random_engine(tok, max_context=8192), tok).start()
    try:
        out = subprocess.run(
            [sys.executable, str(AGENT), "--base-url", gw.url, "--admin-key", ADMIN, "--domain", "mock",
             "--episodes", "2", "--group-size", "2", "--max-tokens", "24", "--max-steps", "6", "--user-max-tokens", "16"],
            capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, **user_simulator.env()})
        episodes = lines(out)
    finally:
        gw.stop()
    assert len(episodes) == 2 and all(e["trajectories"] == 1 for e in episodes), episodes
    # a random policy solves nothing: tau2 ends it at max_steps (or it stops), and tau2's evaluation gives 0
    assert all(e["reward"] == 0.0 and e["termination"] in ("max_steps", "agent_stop", "user_stop") for e in episodes)
    trajs = gw.published
    assert len(trajs) == 2 and {t.group_size for t in trajs} == {2} and len({t.group_id for t in trajs}) == 1
    assert all(t.task_id.startswith("tau2-mock-") and t.scored and t.reward == 0.0 for t in trajs)
    # several agent turns in one token-exact trajectory: the user's turns between them are masked; tau2's policy and
    # tools are the prompt
    assert all(0 in t.loss_mask for t in trajs)
    assert "create_task" in tok.decode(list(trajs[0].prompt_ids))
