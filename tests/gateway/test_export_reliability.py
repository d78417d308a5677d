"""Exports that cannot be published, rewards that do not fit a float32, and end_session answering before the bus
has the export: a trajectory the bus refuses for good is 413 and never holds up the ones behind it, rewards stay in
`max_abs_reward`, and end_session is 200 only once the export is confirmed (503 and still open before)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from services.common.contracts import data_pb2
from services.rollout.gateway.config import FLOAT32_MAX, GatewayConfig
from services.rollout.gateway.outbox import Outbox
from tests.gateway.harness import GatewayServer
from tests.gateway.policies import calculator_replies, scripted_engine
from tests.gateway.test_errors import openai_error

LIMIT = 1500  # bytes: a one-line chat exports far less, a 600-word prompt far more
LONG = "tell me about " + " ".join(f"w{i}" for i in range(600))


def chat(server: GatewayServer, key: str, messages: list[dict]) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 8},
                      headers={"Authorization": f"Bearer {key}"}, timeout=60)


def turn(server: GatewayServer, key: str, messages: list[dict], content: str) -> list[dict]:
    """One more user turn on the conversation; returns it with the assistant's reply appended."""
    messages = [*messages, {"role": "user", "content": content}]
    r = chat(server, key, messages)
    assert r.status_code == 200, r.text
    return [*messages, {k: v for k, v in r.json()["choices"][0]["message"].items() if v is not None}]


def published_for(server: GatewayServer, session_id: str) -> list[data_pb2.Trajectory]:
    return [t for t in server.published if t.work_id == session_id]


@pytest.fixture
def server(request, tok):
    gw = GatewayServer(scripted_engine(tok, calculator_replies), tok, **getattr(request, "param", {})).start()
    yield gw
    gw.hold_publish.clear()
    gw.stop()


# F3: a trajectory over the bus's limit ---------------------------------------------------------------------------
@pytest.mark.parametrize("server", [{"publish_timeout_s": 5.0}], indirect=True)
def test_a_trajectory_the_bus_refuses_as_too_large_is_413_and_the_next_one_is_published(server):
    server.max_payload = LIMIT
    large, small = server.start_session(), server.start_session()
    turn(server, large["api_key"], [], LONG)
    turn(server, small["api_key"], [], "hi")
    r = server.session_post(large["api_key"], "/rl/end_session")
    error = openai_error(r, 413)
    assert f"max_payload {LIMIT}" in error["message"] and " bytes is over " in error["message"]
    assert error["code"] == "trajectory_too_large"
    info = server.session_info(large["session_id"])
    assert info["state"] == "ended" and info["end_reason"] == "too_large"  # closed without an export: no slot held
    started = time.monotonic()
    ended = server.session_post(small["api_key"], "/rl/end_session")
    assert ended.status_code == 200 and ended.json()["published"], ended.text
    assert time.monotonic() - started < server.config.publish_timeout_s
    assert len(published_for(server, small["session_id"])) == 1 and not published_for(server, large["session_id"])
    outbox = server.gateway.outbox
    assert outbox.dropped == 1 and outbox.pending == 0
    openai_error(server.session_post(large["api_key"], "/rl/end_session"), 413)  # the same answer again


@pytest.mark.parametrize("server", [{"max_trajectory_bytes": LIMIT}], indirect=True)
def test_an_export_over_max_trajectory_bytes_is_413_before_it_reaches_the_bus(server):
    s = server.start_session()
    turn(server, s["api_key"], [], LONG)
    error = openai_error(server.session_post(s["api_key"], "/rl/end_session"), 413)
    assert f"over the {LIMIT} bytes one trajectory may take (max_trajectory_bytes)" in error["message"]
    assert server.gateway.outbox.failures == 0 and not published_for(server, s["session_id"])
    assert server.gateway.budget.snapshot()["admitted"] == 0  # the group will never train: its slot is free


async def test_the_outbox_drops_a_permanent_failure_and_publishes_the_rest():
    published = []

    async def publish(members: list[data_pb2.Trajectory]) -> None:
        if any(t.trajectory_id == "bad" for t in members):
            raise ValueError("refused for good")
        published.extend(t.trajectory_id for t in members)

    outbox = Outbox(publish, retry_s=30.0)  # a retry of the bad one would outlast the test's deadline
    outbox.start()
    bad, good = outbox.put([data_pb2.Trajectory(trajectory_id="bad"), data_pb2.Trajectory(trajectory_id="good")])
    assert await asyncio.wait_for(good, 5) is True
    with pytest.raises(ValueError, match="refused for good"):
        bad.result()
    assert published == ["good"] and outbox.dropped == 1 and outbox.pending == 0
    await outbox.close(1.0)


# F7: rewards within max_abs_reward ------------------------------------------------------------------------------
def test_a_reward_past_max_abs_reward_is_400_naming_the_field(server):
    s = server.start_session()
    turn(server, s["api_key"], [], "hi")
    for reward in (1e39, -2e6):
        error = openai_error(server.session_post(s["api_key"], "/rl/set_reward", {"reward": reward}), 400, "reward")
        assert "max_abs_reward" in error["message"]
    assert server.session_post(s["api_key"], "/rl/set_reward", {"reward": 1e6}).status_code == 200
    with pytest.raises(ValueError, match="max_abs_reward"):
        GatewayConfig(admin_key="test-admin-key", max_abs_reward=1e39)


@pytest.mark.parametrize("server", [{"max_abs_reward": FLOAT32_MAX}], indirect=True)
def test_turn_rewards_whose_float32_sum_overflows_are_400_at_end_session(server):
    s = server.start_session()
    key = s["api_key"]
    messages = turn(server, key, [], "hi")
    assert server.session_post(key, "/rl/set_reward", {"reward": 3e38}).status_code == 200
    turn(server, key, messages, "and again")
    assert server.session_post(key, "/rl/set_reward", {"reward": 3e38}).status_code == 200  # each one fits
    error = openai_error(server.session_post(key, "/rl/end_session"), 400, "reward")
    assert "inf" in error["message"] and "max_abs_reward" in error["message"]
    assert server.session_info(s["session_id"])["state"] == "active" and not published_for(server, s["session_id"])
    # the agent fixes its rewards and ends again
    assert server.session_post(key, "/rl/set_reward", {"reward": 1.0}).status_code == 200
    assert server.session_post(key, "/rl/end_session").json()["published"]
    (traj,) = published_for(server, s["session_id"])
    assert traj.reward == pytest.approx(3e38 + 1.0, rel=1e-6)


def test_turn_rewards_whose_sum_passes_max_abs_reward_are_400_at_end_session(server):
    s = server.start_session()
    key = s["api_key"]
    messages = turn(server, key, [], "hi")
    server.session_post(key, "/rl/set_reward", {"reward": 9e5})
    turn(server, key, messages, "and again")
    server.session_post(key, "/rl/set_reward", {"reward": 9e5})
    openai_error(server.session_post(key, "/rl/end_session"), 400, "reward")
    assert server.session_info(s["session_id"])["state"] == "active"


# F8: 200 only once the bus has the export -----------------------------------------------------------------------
@pytest.mark.parametrize("server", [{"publish_timeout_s": 0.5}], indirect=True)
def test_end_session_is_503_and_the_session_stays_open_until_the_export_is_confirmed(server):
    s = server.start_session()
    key = s["api_key"]
    turn(server, key, [], "hi")
    server.hold_publish.set()  # the bus is slow
    for _ in range(2):  # a retry waits for the same export
        r = server.session_post(key, "/rl/end_session")
        error = openai_error(r, 503)
        assert error["code"] == "export_pending" and "end_session again" in error["message"]
        assert int(r.headers["retry-after"]) >= 1
    assert server.session_info(s["session_id"])["state"] == "active"
    r = chat(server, key, [{"role": "user", "content": "more"}])
    assert r.status_code == 409 and "ending" in r.json()["error"]["message"]  # the key is still valid (not 401)
    openai_error(server.session_post(key, "/rl/set_reward", {"reward": 1.0}), 409)
    assert server.gateway.outbox.pending == 1 and not published_for(server, s["session_id"])
    server.hold_publish.clear()  # the bus is back
    ended = server.session_post(key, "/rl/end_session")
    assert ended.status_code == 200, ended.text
    assert ended.json()["published"] and ended.json()["state"] == "ended" and ended.json()["trajectories"] == 1
    assert len(published_for(server, s["session_id"])) == 1


@pytest.mark.parametrize("server", [{"publish_timeout_s": 0.3}], indirect=True)
def test_a_session_whose_export_is_confirmed_later_ends_without_another_call(server):
    s = server.start_session()
    turn(server, s["api_key"], [], "hi")
    server.hold_publish.set()
    openai_error(server.session_post(s["api_key"], "/rl/end_session"), 503)
    assert server.gateway.budget.snapshot()["admitted"] == 1  # its slot is held while the export is unconfirmed
    server.hold_publish.clear()
    deadline = time.time() + 10
    while server.session_info(s["session_id"])["state"] != "ended" and time.time() < deadline:
        time.sleep(0.05)
    assert server.session_info(s["session_id"])["state"] == "ended"
    assert len(published_for(server, s["session_id"])) == 1
