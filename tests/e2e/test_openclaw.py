"""The real OpenClaw CLI (npm, installed into .openclaw on first use) drives meshrl's gateway in front of SmolLM2:
its config names only the gateway (base URL + session key). The exported trajectory is what the engine sampled
(OpenClaw's own token counts and text), the example agent posts the reward, and the second episode's long system
prompt comes from the prefix cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.stack import ROOT
from services.rollout.engines.torch_engine import EngineConfig
from tests.gateway.harness import ADMIN, GatewayServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]
MODEL = ROOT / "artifacts" / "models" / "smollm2-135m-instruct"
AGENT = ROOT / "examples" / "agents" / "openclaw_agent.py"
sys.path.insert(0, str(AGENT.parent))
import openclaw_agent  # noqa: E402  (examples/agents/openclaw_agent.py)


@pytest.fixture(scope="module")
def openclaw() -> Path:
    return openclaw_agent.ensure_openclaw(ROOT / ".openclaw")


@pytest.fixture(scope="module")
def gateway():
    if not (MODEL / "model.safetensors").exists():
        pytest.skip("SmolLM2 is not converted (make test converts it: meshrl model smollm2)")
    from transformers import AutoTokenizer

    engine = EngineConfig(model_path=str(MODEL), max_context=8192, max_batch=8, torch_threads=0).build()
    server = GatewayServer(engine, AutoTokenizer.from_pretrained(MODEL)).start()
    yield server
    server.stop()


def test_openclaw_episodes_through_the_gateway_are_token_exact_and_rewarded(openclaw, gateway):
    session = gateway.start_session("openclaw-1")["sessions"][0]
    config = openclaw_agent.openclaw_config(gateway.url, session["api_key"], "meshrl-policy", 8192, 16)
    result = openclaw_agent.run_episode(openclaw, config, "What is 6 + 2? Reply with 'Answer: <number>'.",
                                        "meshrl-policy", timeout=600)
    assert gateway.session_post(session["api_key"], "/rl/set_reward", {"reward": 0.5}).status_code == 200
    assert gateway.session_post(session["api_key"], "/rl/end_session").status_code == 200
    [traj] = gateway.published
    usage = result["usage"]
    assert (len(traj.prompt_ids), len(traj.completion_ids)) == (usage["input"], usage["output"])
    assert usage["input"] > 2000, "OpenClaw's own system prompt and tools went through the gateway"
    text = gateway.tokenizer.decode(list(traj.completion_ids), skip_special_tokens=True)
    assert text.strip() == result["payloads"][0]["text"].strip(), "OpenClaw got exactly the tokens the engine sampled"
    assert len(traj.behavior_logprobs) == len(traj.versions) == len(traj.completion_ids) and set(traj.versions) == {0}
    assert traj.reward == 0.5 and traj.task_id == "openclaw-1"

    hits = gateway.engine.stats.prefix_cache_hit_tokens
    out = subprocess.run([sys.executable, str(AGENT), "--base-url", gateway.url, "--admin-key", ADMIN,
                          "--episodes", "1", "--group-size", "1", "--task", "addition", "--max-tokens", "16"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    [episode] = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert episode["trajectories"] == 1 and episode["reward"] in (0.0, 0.1, 1.0)
    # the trajectory carries the reward as float32 (0.1 arrives as 0.10000000149)
    assert len(gateway.published) == 2 and gateway.published[1].reward == pytest.approx(episode["reward"], abs=1e-6)
    # parts of OpenClaw's prompt differ per episode (its workspace among them): the shared prefix was 1,184-2,784 tokens
    assert gateway.engine.stats.prefix_cache_hit_tokens - hits >= 1024, "the second episode reused the system prompt"
