"""Sessions: groups, refresh with a fixed key, rewards and turn discount, idle ending, export and publishing."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
from openai import OpenAI

from services.common import trajectory_groups
from services.common.bus import SUBJECT_TRAJ_SCORED, Bus
from services.common.contracts import data_pb2
from services.rollout.gateway import GatewayConfig
from tests.gateway.harness import GatewayServer
from tests.gateway.policies import calculator_replies, scripted_engine


def chat(gw, key: str, text: str = "Hello") -> str:
    c = OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    return c.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], max_tokens=8).id


def published_for(gw, session_id: str) -> list[data_pb2.Trajectory]:
    return [t for t in gw.published if t.work_id == session_id]


def test_group_sessions_share_a_group_and_export_one_trajectory_each(scripted_gw):
    g = scripted_gw.start_session(task_id="grpo-task", group_size=3, metadata={"agent": "test"})
    keys = [s["api_key"] for s in g["sessions"]]
    assert len(set(keys)) == 3 and g["session_id"] == g["sessions"][0]["session_id"]
    for i, key in enumerate(keys):
        chat(scripted_gw, key)
        scripted_gw.session_post(key, "/rl/set_reward", {"reward": float(i)})
        scripted_gw.session_post(key, "/rl/end_session")
    trajs = [t for s in g["sessions"] for t in published_for(scripted_gw, s["session_id"])]
    assert [t.reward for t in trajs] == [0.0, 1.0, 2.0]
    assert {t.group_id for t in trajs} == {g["group_id"]} and {t.group_size for t in trajs} == {3}
    assert {t.task_id for t in trajs} == {"grpo-task"}
    meta = msgpack.unpackb(trajs[1].metadata)
    assert meta["agent"] == {"agent": "test"} and meta["group_index"] == 1 and meta["session_id"] == g["sessions"][1]["session_id"]


def test_group_sessions_that_end_together_travel_as_one_message(tok):
    gw = GatewayServer(scripted_engine(tok, calculator_replies), tok, publish_linger_s=1.0).start()
    try:
        one_message_for_a_group_ending_together(gw)
    finally:
        gw.stop()
    with pytest.raises(ValueError, match="publish_linger_s"):
        GatewayConfig(admin_key="test-admin-key-0123456789", publish_linger_s=-0.1)


def one_message_for_a_group_ending_together(scripted_gw: GatewayServer) -> None:
    g = scripted_gw.start_session(task_id="grpo-task", group_size=4)
    keys = [s["api_key"] for s in g["sessions"]]
    for key in keys:
        chat(scripted_gw, key)
    alone = scripted_gw.session_post(keys[0], "/rl/end_session")  # ends before the others: waits, then goes alone
    assert alone.status_code == 200 and alone.json()["published"] and len(scripted_gw.messages) == 1
    with ThreadPoolExecutor(3) as pool:  # the other three end at the same moment (within the 1 s linger)
        ended = list(pool.map(lambda key: scripted_gw.session_post(key, "/rl/end_session"), keys[1:]))
    assert all(r.status_code == 200 and r.json()["published"] for r in ended)
    trajs = [t for s in g["sessions"] for t in published_for(scripted_gw, s["session_id"])]
    assert len(trajs) == 4 and {t.group_id for t in trajs} == {g["group_id"]}
    assert [len(m) for m in scripted_gw.messages] == [1, 3]
    assert scripted_gw.gateway.outbox.messages == 2 and scripted_gw.gateway.outbox.published == 4


def test_starting_again_with_the_same_key_ends_the_previous_session(scripted_gw):
    first = scripted_gw.start_session(api_key="fixed-key-openclaw")
    chat(scripted_gw, "fixed-key-openclaw")
    second = scripted_gw.start_session(api_key="fixed-key-openclaw")
    assert second["session_id"] != first["session_id"] and second["api_key"] == "fixed-key-openclaw"
    (old,) = published_for(scripted_gw, first["session_id"])
    assert old.reward == 0.0 and msgpack.unpackb(old.metadata)["end_reason"] == "refreshed"
    chat(scripted_gw, "fixed-key-openclaw")
    assert len(scripted_gw.session_info(second["session_id"])["interactions"]) == 1


def test_reward_targets_and_end_is_idempotent(scripted_gw):
    s = scripted_gw.start_session()
    key = s["api_key"]
    r = scripted_gw.session_post(key, "/rl/set_reward", {"reward": 1.0})
    assert r.status_code == 409  # no interaction yet
    first, second = chat(scripted_gw, key, "a"), chat(scripted_gw, key, "b")
    assert scripted_gw.session_post(key, "/rl/set_reward", {"reward": 0.25, "interaction_id": first}).json()["interaction_ids"] == [first]
    assert scripted_gw.session_post(key, "/rl/set_reward", {"reward": 1.0}).json()["interaction_ids"] == [second]
    ended = scripted_gw.session_post(key, "/rl/end_session").json()
    again = scripted_gw.session_post(key, "/rl/end_session").json()
    assert ended == again and ended["interaction_count"] == 2 and ended["published"]
    assert sorted(t.reward for t in published_for(scripted_gw, s["session_id"])) == [0.25, 1.0]  # two independent paths
    assert scripted_gw.session_post(key, "/rl/set_reward", {"reward": 2.0}).status_code == 409


def test_admin_key_can_reward_and_end_any_session(scripted_gw):
    s = scripted_gw.start_session()
    chat(scripted_gw, s["api_key"])
    r = scripted_gw.admin("POST", "/rl/set_reward", json={"session_id": s["session_id"], "reward": 0.75})
    assert r.status_code == 200
    assert scripted_gw.admin("POST", "/rl/end_session", json={"session_id": s["session_id"]}).json()["trajectories"] == 1
    assert published_for(scripted_gw, s["session_id"])[0].reward == 0.75


def test_interaction_export_with_turn_discount(tok):
    gw = GatewayServer(scripted_engine(tok, calculator_replies), tok, export_mode="interaction", turn_discount=0.5).start()
    try:
        s = gw.start_session()
        c = OpenAI(base_url=gw.url + "/v1", api_key=s["api_key"], max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        for turn in range(3):
            reply = c.chat.completions.create(model="m", messages=messages).choices[0].message
            messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": f"again {turn}"}]
        gw.session_post(s["api_key"], "/rl/set_reward", {"reward": 1.0})
        gw.session_post(s["api_key"], "/rl/end_session")
        trajs = published_for(gw, s["session_id"])
        assert [t.reward for t in trajs] == [0.25, 0.5, 1.0]
        assert all(set(t.loss_mask) == {1} and t.group_size == 1 for t in trajs)
        assert [msgpack.unpackb(t.metadata)["turn"] for t in trajs] == [0, 1, 2]
    finally:
        gw.stop()


def test_idle_sessions_end_on_their_own(tok):
    gw = GatewayServer(scripted_engine(tok, calculator_replies), tok, idle_timeout_s=1.5, reap_interval_s=0.05).start()
    try:
        s = gw.start_session()
        chat(gw, s["api_key"])
        deadline = time.time() + 10
        while not published_for(gw, s["session_id"]) and time.time() < deadline:
            time.sleep(0.05)
        (traj,) = published_for(gw, s["session_id"])
        assert msgpack.unpackb(traj.metadata)["end_reason"] == "idle" and traj.reward == 0.0
        r = gw.session_post(s["api_key"], "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 409 and "ended" in r.json()["error"]["message"]
    finally:
        gw.stop()


def test_publish_failures_are_retried_not_lost(scripted_gw):
    s = scripted_gw.start_session()
    chat(scripted_gw, s["api_key"])
    scripted_gw.publish_fails = 2
    ended = scripted_gw.session_post(s["api_key"], "/rl/end_session").json()
    assert ended["published"] and len(published_for(scripted_gw, s["session_id"])) == 1


def test_trajectories_reach_jetstream(nats_server, tok):
    """publish -> traj.scored on a real nats-server, as the rollout service wires it."""
    holder: dict = {}

    async def publish(members: list[data_pb2.Trajectory]) -> None:
        if "bus" not in holder:
            holder["bus"] = await Bus.connect(nats_server.url, name="gateway-test")
        await trajectory_groups.publish(holder["bus"], SUBJECT_TRAJ_SCORED, members)  # as the rollout service does

    gw = GatewayServer(scripted_engine(tok, calculator_replies), tok)
    gw.app.state.gateway.outbox._publish = publish
    gw.start()
    try:
        s = gw.start_session()
        chat(gw, s["api_key"])
        gw.session_post(s["api_key"], "/rl/set_reward", {"reward": 1.0})
        assert gw.session_post(s["api_key"], "/rl/end_session").json()["published"]
    finally:
        gw.stop()

    async def read_back() -> data_pb2.Trajectory:
        bus = await Bus.connect(nats_server.url, name="reader")
        sub = await bus.js.pull_subscribe_bind(durable="builder", stream="TRAJ")
        (msg,) = await sub.fetch(1, timeout=5)
        await msg.ack()
        await bus.close()
        (traj,) = trajectory_groups.decode(msg).trajectories  # a session's group message: itself
        return traj

    traj = asyncio.run(read_back())
    assert traj.work_id == s["session_id"] and traj.reward == 1.0 and traj.source == "gateway"


@pytest.mark.parametrize("body,field", [({}, "task_id"), ({"task_id": "t", "group_size": 0}, "group_size"),
                                        ({"task_id": "t", "surprise": 1}, "surprise"),
                                        ({"task_id": "t", "api_key": "k" * 10, "group_size": 2}, "api_key")])
def test_start_session_names_the_bad_field(scripted_gw, body, field):
    r = scripted_gw.admin("POST", "/rl/start_session", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_start_session_idempotency_key(scripted_gw):
    headers = {"Idempotency-Key": "abc-123"}
    a = scripted_gw.admin("POST", "/rl/start_session", json={"task_id": "t"}, headers=headers).json()
    b = scripted_gw.admin("POST", "/rl/start_session", json={"task_id": "t"}, headers=headers).json()
    assert a == b


def test_a_persons_preference_between_two_episodes_rewards_and_ends_both(scripted_gw):
    g = scripted_gw.start_session(task_id="label-me", group_size=2)
    (a, b) = g["sessions"]
    for s in (a, b):
        chat(scripted_gw, s["api_key"])
    assert scripted_gw.session_post(a["api_key"], "/rl/set_preference",
                                    {"chosen": b["session_id"], "rejected": a["session_id"]}).status_code == 401
    other = scripted_gw.start_session(task_id="another")
    chat(scripted_gw, other["api_key"])
    for body, status, field in (
            ({"chosen": b["session_id"], "rejected": other["session_id"]}, 400, "rejected"),
            ({"chosen": b["session_id"], "rejected": b["session_id"]}, 400, "rejected"),
            ({"chosen": "nope", "rejected": a["session_id"]}, 404, "chosen"),
            ({"chosen": b["session_id"]}, 400, "rejected")):
        r = scripted_gw.admin("POST", "/rl/set_preference", json=body)
        assert r.status_code == status and field in r.text, (body, r.text)
    r = scripted_gw.admin("POST", "/rl/set_preference", json={"chosen": b["session_id"], "rejected": a["session_id"]})
    assert r.status_code == 200 and r.json()["group_id"] == g["group_id"]
    (ta,), (tb,) = (published_for(scripted_gw, s["session_id"]) for s in (a, b))
    assert (tb.reward, ta.reward) == (1.0, 0.0) and ta.group_id == tb.group_id   # a pair dpo takes b over a
    again = scripted_gw.admin("POST", "/rl/set_preference", json={"chosen": a["session_id"], "rejected": b["session_id"]})
    assert again.status_code == 409   # ended: the label stands
