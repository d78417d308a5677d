"""Bad input and auth: 401 / 400 naming the field / 413 / 409, in the called API's error shape; nothing half-recorded."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.harness import ADMIN, GatewayServer
from tests.gateway.policies import calculator_replies, scripted_engine

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MSGS = {"model": "c", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def gw(tok):
    server = GatewayServer(scripted_engine(tok, calculator_replies, max_context=1024), tok, max_body_bytes=8192).start()
    yield server
    server.stop()


@pytest.fixture
def session(gw):
    s = gw.start_session()
    yield s
    assert gw.session_info(s["session_id"])["interactions"] == []  # failed requests recorded nothing


def call(gw, path: str, body, key: str | None, *, anthropic: bool = False, raw: bytes | None = None) -> httpx.Response:
    headers = {} if key is None else ({"x-api-key": key} if anthropic else {"Authorization": f"Bearer {key}"})
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(gw.url + path, content=content, headers={"content-type": "application/json", **headers}, timeout=30)


def openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param and err["message"].startswith(param)
    return err


def anthropic_error(r: httpx.Response, status: int, kind: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    return body["error"]


def test_missing_and_unknown_keys_are_401_in_each_dialect(gw, session):
    assert openai_error(call(gw, "/v1/chat/completions", CHAT, None), 401)["type"] == "authentication_error"
    openai_error(call(gw, "/v1/chat/completions", CHAT, "sk-nope"), 401)
    openai_error(call(gw, "/v1/responses", {"model": "m", "input": "x"}, "sk-nope"), 401)
    anthropic_error(call(gw, "/v1/messages", MSGS, None, anthropic=True), 401, "authentication_error")
    anthropic_error(call(gw, "/v1/messages", MSGS, "sk-nope", anthropic=True), 401, "authentication_error")
    r = httpx.get(gw.url + "/v1/models", timeout=10)
    assert r.status_code == 401


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "temperature": 3}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "n": 99}, "n"),
    ({**CHAT, "stop": 5}, "stop"),
    ({**CHAT, "logit_bias": {"5": 10}}, "logit_bias"),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ({**CHAT, "frobnicate": True}, "frobnicate"),
    ({**CHAT, "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"model": "m", "messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),  # only a user's message may hold images
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0].type"),
    ({"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]}, "messages"),
])
def test_chat_bad_input_is_400_naming_the_field(gw, session, body, param):
    openai_error(call(gw, "/v1/chat/completions", body, session["api_key"]), 400, param)


@pytest.mark.parametrize("body,needle", [
    ({"model": "c", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({**MSGS, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({**MSGS, "temperature": 1.5}, "temperature"),
    ({**MSGS, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({**MSGS, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
])
def test_messages_bad_input_is_400_in_anthropic_shape(gw, session, body, needle):
    err = anthropic_error(call(gw, "/v1/messages", body, session["api_key"], anthropic=True), 400, "invalid_request_error")
    assert err["message"].startswith(needle)


def test_bad_json_and_non_object_bodies(gw, session):
    openai_error(call(gw, "/v1/chat/completions", None, session["api_key"], raw=b"{not json"), 400, "body")
    openai_error(call(gw, "/v1/chat/completions", None, session["api_key"], raw=b"[1, 2]"), 400, "body")
    anthropic_error(call(gw, "/v1/messages", None, session["api_key"], anthropic=True, raw=b"{"), 400,
                    "invalid_request_error")


def test_oversized_bodies_are_413(gw, session):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 10000}]}
    openai_error(call(gw, "/v1/chat/completions", big, session["api_key"]), 413)
    anthropic_error(call(gw, "/v1/messages", {**MSGS, "system": "y" * 10000}, session["api_key"], anthropic=True), 413,
                    "request_too_large")


def test_admin_routes_need_the_admin_key(gw, session):
    r = call(gw, "/rl/start_session", {"task_id": "t"}, session["api_key"])
    openai_error(r, 401)
    openai_error(call(gw, "/rl/start_session", {"task_id": "t"}, None), 401)
    r = httpx.post(gw.url + "/rl/set_reward", json={"reward": 1.0}, headers={"Authorization": f"Bearer {ADMIN}"})
    openai_error(r, 400, "session_id")
    r = httpx.post(gw.url + "/rl/end_session", json={"session_id": "sess-missing"}, headers={"Authorization": f"Bearer {ADMIN}"})
    openai_error(r, 404, "session_id")
    assert httpx.get(gw.url + "/rl/status", headers={"Authorization": f"Bearer {session['api_key']}"}).status_code == 401


def test_bad_rewards_name_the_field(gw, session):
    key = session["api_key"]
    openai_error(call(gw, "/rl/set_reward", {}, key), 400, "reward")
    openai_error(call(gw, "/rl/set_reward", {"reward": "high"}, key), 400, "reward")
    openai_error(call(gw, "/rl/set_reward", None, key, raw=b'{"reward": NaN}'), 400, "reward")
    assert call(gw, "/rl/set_reward", {"reward": 1.0}, key).status_code == 409  # nothing to reward yet


def test_ended_session_is_409_and_not_retried(gw):
    s = gw.start_session()
    assert call(gw, "/rl/end_session", {}, s["api_key"]).status_code == 200
    r = call(gw, "/v1/chat/completions", CHAT, s["api_key"])
    assert openai_error(r, 409)["type"] == "conflict_error" and r.headers["x-should-retry"] == "false"
    anthropic_error(call(gw, "/v1/messages", MSGS, s["api_key"], anthropic=True), 409, "invalid_request_error")


def test_unknown_routes_and_previous_response_ids(gw, session):
    r = httpx.post(gw.url + "/v1/embeddings", json={}, headers={"Authorization": f"Bearer {session['api_key']}"})
    openai_error(r, 404)
    r = call(gw, "/v1/responses", {"model": "m", "input": "x", "previous_response_id": "resp_nope"}, session["api_key"])
    openai_error(r, 400, "previous_response_id")


def test_admin_key_calls_are_served_but_not_recorded(tok):
    gw = GatewayServer(scripted_engine(tok, calculator_replies), tok).start()
    try:
        r = call(gw, "/v1/chat/completions", CHAT, ADMIN)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello there, friend!"
        assert gw.admin("GET", "/rl/status").json()["sessions_active"] == 0
    finally:
        gw.stop()
    assert gw.published == []


def test_engine_stopping_mid_request_is_503_or_an_error_event_and_nothing_is_recorded(tok):
    from tests.gateway.policies import random_engine

    gw = GatewayServer(random_engine(tok, seed=5), tok).start()
    try:
        s = gw.start_session()
        body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 1500, "temperature": 1.0}
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60,
                          headers={"Authorization": f"Bearer {s['api_key']}"}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the head goes out before the sequence is submitted
            assert next(line for line in lines if line).startswith("data: "), "a first delta: generation under way"
            gw.engine.stop()
            rest = [line for line in lines if line]
        assert gw.engine.submitted[-1].finish_reason == "abort", "the stream outlived the engine"
        assert json.loads(rest[-1][6:])["error"]["type"] == "server_error"
        assert gw.session_info(s["session_id"])["interactions"] == []
        r = call(gw, "/v1/chat/completions", body, s["api_key"])
        assert openai_error(r, 503)["message"].startswith("the engine")
    finally:
        gw.stop()
