"""Sessions graded by a verifier and agents' code run in the reward service's sandbox, end to end on loopback: a
real reward gRPC server (its sandbox is bubblewrap), the gateway's own RewardClient, a scripted tool-calling policy
driven through the official openai SDK, and the exported trajectory scored by the reward service's Scorer."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from services.common.contracts import data_pb2
from services.reward.client import RewardClient
from services.reward.scoring import Scorer, final_turn
from tests.gateway.harness import GatewayServer, RewardServer
from tests.gateway.policies import scripted_engine

RUN_PYTHON = {"type": "function", "function": {
    "name": "run_python", "description": "Run a Python program; returns its stdout and stderr.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
TESTS = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
GRADING = {"verifier": "code_tests", "tests": TESTS, "entry_point": "add"}


def code_agent_replies(prompt: str, forced: str = "") -> str:
    """Tries its function with run_python first, then answers with it; 'subtract' in the task: the wrong one."""
    op = "-" if "subtract" in prompt else "+"
    program = f"def add(a, b):\n    return a {op} b\n"
    if "<tool_response>" not in prompt:
        call = {"name": "run_python", "arguments": {"code": program + "print(add(2, 3))"}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    return f"It prints the sum. Final answer:\n```python\n{program}```"


@pytest.fixture(scope="module")
def reward_server():
    server = RewardServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def graded_gw(tok, reward_server):
    server = GatewayServer(scripted_engine(tok, code_agent_replies), tok,
                           reward=RewardClient(reward_server.address, timeout_s=30)).start()
    yield server
    server.stop()


def run_code(gw, key: str, body: dict):
    return gw.session_post(key, "/rl/run_code", body)


def episode(gw, key: str, task: str) -> str:
    """The agent loop as a user writes it: the SDK, the run_python tool through /rl/run_code, a final answer."""
    client = OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    messages = [{"role": "user", "content": task}]
    for _ in range(3):
        reply = client.chat.completions.create(model="m", messages=messages, tools=[RUN_PYTHON], max_tokens=256)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return msg.content
        for call in msg.tool_calls:
            out = run_code(gw, key, {"code": json.loads(call.function.arguments)["code"]})
            assert out.status_code == 200, out.text
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out.json()["stdout"]})
    raise AssertionError("no final answer in 3 turns")


def exported(gw, session_id: str) -> data_pb2.Trajectory:
    (traj,) = [t for t in gw.published if t.work_id == session_id]
    return traj


def score(tok, traj: data_pb2.Trajectory) -> data_pb2.Trajectory:
    return Scorer(lambda ids: tok.decode(ids, skip_special_tokens=True), "exact").score(traj)


def test_run_code_runs_in_the_reward_services_sandbox(graded_gw):
    key = graded_gw.start_session()["api_key"]
    r = run_code(graded_gw, key, {"code": "import os\nprint(6 * 7, os.getcwd(), os.path.exists('/work'))"})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "ok" and r.json()["stdout"].split() == ["42", "/tmp", "False"]
    r = run_code(graded_gw, key, {"code": "import sys\nsys.stderr.write('boom')\nsys.exit(3)"})
    assert r.json()["status"] == "error" and r.json()["exit_code"] == 3 and "boom" in r.json()["stderr"]
    r = run_code(graded_gw, key, {"code": "while True: pass", "timeout_s": 1})
    assert r.json()["status"] == "timeout" and r.json()["exit_code"] is None
    for body, field in (({"code": ""}, "code"), ({"code": "print(1)", "timeout_s": 1e6}, "timeout_s"),
                        ({"code": "print(1)", "language": "cobol"}, "language"), ({"code": 1}, "code"),
                        ({"code": "print(1)", "shell": True}, "shell")):
        r = run_code(graded_gw, key, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
    assert graded_gw.admin("POST", "/rl/run_code", json={"code": "print(1)"}).status_code == 403
    graded_gw.session_post(key, "/rl/end_session")
    assert run_code(graded_gw, key, {"code": "print(1)"}).status_code == 409


def test_a_graded_session_is_scored_by_its_verifier_on_its_last_answer(graded_gw, tok):
    results = {}
    for task in ("Write add(a, b) returning the sum.", "Write add(a, b); subtract, as you like it."):
        started = graded_gw.start_session(task_id="add", grading=GRADING)
        assert started["graded_by"] == "code_tests"
        answer = episode(graded_gw, started["api_key"], task)
        graded_gw.session_post(started["api_key"], "/rl/end_session")
        traj = exported(graded_gw, started["session_id"])
        # unscored, carrying the session's grading: the rollout publishes it to traj.raw, not traj.scored
        assert not traj.scored and traj.verifier == "code_tests" and traj.grading.response == "final_turn"
        assert sum(traj.loss_mask) < len(traj.loss_mask)  # the tool result travels in it, masked
        last = tok.decode(final_turn(traj), skip_special_tokens=True)
        assert "def add" in last and "run_python" not in last and last.strip() == answer.strip()
        results[task] = score(tok, traj)
    right, wrong = results.values()
    assert (right.reward, right.scored, right.verifier) == (1.0, True, "code_tests")
    assert wrong.reward == 0.0


def test_add_reward_puts_the_agents_reward_on_top_of_the_verifiers(graded_gw, tok):
    started = graded_gw.start_session(grading={**GRADING, "add_reward": True})
    episode(graded_gw, started["api_key"], "Write add(a, b).")
    graded_gw.session_post(started["api_key"], "/rl/set_reward", {"reward": 0.25})
    graded_gw.session_post(started["api_key"], "/rl/end_session")
    assert score(tok, exported(graded_gw, started["session_id"])).reward == pytest.approx(1.25)


def test_an_ungraded_session_keeps_the_agents_reward_and_goes_straight_to_the_builder(graded_gw):
    started = graded_gw.start_session()
    episode(graded_gw, started["api_key"], "Write add(a, b).")
    graded_gw.session_post(started["api_key"], "/rl/set_reward", {"reward": 0.5})
    graded_gw.session_post(started["api_key"], "/rl/end_session")
    traj = exported(graded_gw, started["session_id"])
    assert traj.scored and traj.reward == 0.5 and traj.verifier == "agent" and not traj.HasField("grading")


@pytest.mark.parametrize(("grading", "field", "problem"), [
    ({"answer": "5"}, "grading.verifier", "required"),
    ({"verifier": "no_such_verifier"}, "grading.verifier", "unknown"),
    ({"verifier": "exact", "answer": 5}, "grading.answer", "string"),
    ({"verifier": "exact", "answer": "5", "response": "everything"}, "grading.response", "final_turn"),
    ({"verifier": "exact", "answer": "5", "add_reward": "yes"}, "grading.add_reward", "boolean"),
    ("exact", "grading", "object"),
])
def test_bad_grading_is_refused_at_start_naming_the_field(graded_gw, grading, field, problem):
    r = graded_gw.admin("POST", "/rl/start_session", json={"task_id": "t", "grading": grading})
    assert r.status_code == 400 and r.json()["error"]["param"] == field and problem in r.json()["error"]["message"]


def test_without_a_reward_service_run_code_says_so(scripted_gw):
    key = scripted_gw.start_session()["api_key"]
    r = run_code(scripted_gw, key, {"code": "print(1)"})
    assert r.status_code == 501 and "reward_address" in r.json()["error"]["message"]


def test_final_turn_is_the_last_run_of_sampled_tokens():
    traj = data_pb2.Trajectory(completion_ids=[1, 2, 3, 4, 5, 6, 7], loss_mask=[1, 1, 0, 0, 1, 1, 0])
    assert final_turn(traj) == [5, 6]
    assert final_turn(data_pb2.Trajectory(completion_ids=[1, 2])) == [1, 2]
    assert final_turn(data_pb2.Trajectory(completion_ids=[1, 2], loss_mask=[0, 0])) == []
