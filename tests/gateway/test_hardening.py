"""The gateway under hostile or unlucky input: authentication before any body is read, strict JSON with 4xx in
the API's own shape, only documented template switches, bounded caches and queues (429 when full), heavy work
off the event loop, and session ends that are safe under concurrency."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import pytest

from services.rollout.gateway.dedupe import IdempotencyCache, ReplayCache
from services.rollout.gateway.errors import ApiError
from services.rollout.gateway.offload import Offload
from tests.gateway.harness import ADMIN, GatewayServer
from tests.gateway.policies import calculator_replies, scripted_engine
from tests.gateway.test_errors import anthropic_error, call, openai_error

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
MSGS = {"model": "c", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def gw(tok):
    server = GatewayServer(scripted_engine(tok, calculator_replies, max_context=1024), tok, max_body_bytes=64 * 1024,
                           offload_bytes=2048, max_session_interactions=3).start()
    yield server
    server.stop()


def test_reward_and_end_authenticate_before_reading_the_body(gw):
    garbage = b"{" * 5000
    for path in ("/rl/set_reward", "/rl/end_session", "/rl/start_session"):
        openai_error(call(gw, path, None, "sk-not-a-key", raw=garbage), 401)
        openai_error(call(gw, path, None, None, raw=garbage), 401)
    s = gw.start_session()
    openai_error(call(gw, "/rl/start_session", {"task_id": "x"}, s["api_key"]), 401)  # a session key is not admin


@pytest.mark.parametrize("raw, status", [
    (b"[" * 60_000, 400), (b'{"a":' * 70 + b"1" + b"}" * 70, 400), (b"\xff\xfe{}", 400), (b'{"model": "\\ud800"}', 400),
    (b"[1, 2]", 400), (b'{"model": ', 400), (b"x" * (64 * 1024 + 1), 413), (b"", 400),
])
def test_malformed_deep_or_oversized_json_is_a_4xx_in_the_api_s_own_shape(gw, raw, status):
    key = gw.start_session()["api_key"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/rl/set_reward"):
        openai_error(call(gw, path, None, key, raw=raw), status)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        anthropic_error(call(gw, path, None, key, anthropic=True, raw=raw), status,
                        "request_too_large" if status == 413 else "invalid_request_error")
    openai_error(call(gw, "/rl/start_session", None, ADMIN, raw=raw), status)


def test_only_documented_template_switches_are_accepted(gw):
    key = gw.start_session()["api_key"]
    for kwargs, param in (({"chat_template": "{{ 7 * 7 }}"}, "chat_template_kwargs.chat_template"),
                          ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
                          ({"enable_thinking": "{{ x }}"}, "chat_template_kwargs.enable_thinking"),
                          ("x", "chat_template_kwargs")):
        openai_error(call(gw, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": kwargs}, key), 400, param)
    r = call(gw, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}, key)
    assert r.status_code == 200, r.text


def test_token_ids_and_sampling_out_of_range_are_400_naming_the_field(gw, tok):
    key = gw.start_session()["api_key"]
    vocab = gw.gateway.vocab_size
    openai_error(call(gw, "/v1/completions", {"model": "m", "prompt": [5, vocab]}, key), 400, "prompt")
    openai_error(call(gw, "/v1/completions", {"model": "m", "prompt": [5, -1]}, key), 400, "prompt")
    openai_error(call(gw, "/v1/completions", {"model": "m", "prompt": [2 ** 70]}, key), 400, "prompt")
    openai_error(call(gw, "/v1/chat/completions", None, key, raw=json.dumps(CHAT)[:-1].encode() + b', "temperature": NaN}'),
                 400, "temperature")
    openai_error(call(gw, "/v1/chat/completions", {**CHAT, "top_k": 10 ** 30}, key), 400, "top_k")
    anthropic_error(call(gw, "/v1/messages", {**MSGS, "temperature": 1e309}, key, anthropic=True), 400,
                    "invalid_request_error")
    assert gw.gateway.backend.engine.stats.steps_failed == 0


def test_racing_end_session_calls_all_succeed_with_one_export(gw):
    s = gw.start_session()
    assert call(gw, "/v1/chat/completions", CHAT, s["api_key"]).status_code == 200
    before = len(gw.published)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: gw.session_post(s["api_key"], "/rl/end_session") if i % 2 else
                                gw.admin("POST", "/rl/end_session", json={"session_id": s["session_id"]}), range(8)))
    assert [r.status_code for r in results] == [200] * 8, [r.text for r in results]
    assert len({json.dumps(r.json(), sort_keys=True) for r in results}) <= 2  # "published" may flip to true
    assert len(gw.published) - before == 1


def test_a_full_session_is_429_and_tells_the_sdk_not_to_retry(gw):
    key = gw.start_session()["api_key"]
    for _ in range(3):
        assert call(gw, "/v1/chat/completions", CHAT, key).status_code == 200
    r = call(gw, "/v1/chat/completions", CHAT, key)
    openai_error(r, 429)
    assert r.headers["x-should-retry"] == "false" and "end it" in r.json()["error"]["message"]
    assert gw.session_post(key, "/rl/end_session").status_code == 200


def test_concurrent_starts_with_one_idempotency_key_make_one_group(gw):
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: gw.admin("POST", "/rl/start_session", headers={"Idempotency-Key": "idem-7"},
                                                   json={"task_id": "t", "group_size": 2}), range(6)))
    assert [r.status_code for r in results] == [201] * 6
    assert len({r.json()["group_id"] for r in results}) == 1
    openai_error(gw.admin("POST", "/rl/start_session", headers={"Idempotency-Key": "k" * 300}, json={"task_id": "t"}),
                 400, "Idempotency-Key")


def test_large_bodies_and_count_tokens_run_off_the_loop(gw):
    key = gw.start_session()["api_key"]
    offload = gw.gateway.offload
    before = offload.offloaded
    big = json.dumps(CHAT).encode() + b" " * 4000  # large on the wire, a short prompt
    assert call(gw, "/v1/chat/completions", None, key, raw=big).status_code == 200
    assert offload.offloaded == before + 2  # parsed, then rendered and tokenized, on a worker thread
    r = call(gw, "/v1/messages/count_tokens", {"model": "c", "messages": MSGS["messages"]}, key, anthropic=True)
    assert r.status_code == 200 and r.json()["input_tokens"] > 0 and offload.offloaded == before + 3


def test_end_session_while_the_outbox_is_full_is_429_and_loses_nothing(tok):
    server = GatewayServer(scripted_engine(tok, calculator_replies), tok, max_pending_publish=1,
                           publish_timeout_s=0.5).start()
    try:
        server.publish_fails = 10 ** 9  # the bus is down
        first, second = server.start_session(), server.start_session()
        for s in (first, second):
            assert call(server, "/v1/chat/completions", CHAT, s["api_key"]).status_code == 200
        server.session_post(first["api_key"], "/rl/end_session")  # waits publish_timeout_s at most, then answers
        r = server.session_post(second["api_key"], "/rl/end_session")
        openai_error(r, 429)
        assert server.session_info(second["session_id"])["state"] == "active"
        server.publish_fails = 0  # the bus is back: the outbox drains, then the end goes through
        deadline = time.time() + 30
        while server.gateway.outbox.pending and time.time() < deadline:
            time.sleep(0.05)
        assert server.session_post(second["api_key"], "/rl/end_session").json()["trajectories"] == 1
        assert {t.group_id for t in server.published} == {first["group_id"], second["group_id"]}
    finally:
        server.stop()


async def test_caches_and_queues_are_bounded():
    replays = ReplayCache(600, max_entries=2)
    a = replays.register("s", "a")
    replays.register("s", "b")
    with pytest.raises(ApiError) as err:
        replays.register("s", "c")  # both still running
    assert err.value.status == 429
    replays.resolve("s", "a", a, object())
    replays.register("s", "c")  # the finished one makes room
    assert len(replays) == 2 and replays.lookup("s", "a") is None
    idem = IdempotencyCache(600, max_entries=1)
    fut = idem.begin("k1")
    with pytest.raises(ApiError) as err:
        idem.begin("k2")
    assert err.value.status == 429
    idem.fail("k1", fut)
    idem.begin("k2")
    offload = Offload(workers=1, queue=0, threshold=0)
    started = asyncio.Event()
    loop = asyncio.get_running_loop()
    release = asyncio.Event()

    def slow() -> int:
        loop.call_soon_threadsafe(started.set)
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(10)
        return 1

    job = asyncio.ensure_future(offload.run(10, slow))
    await started.wait()
    with pytest.raises(ApiError) as err:
        await offload.run(10, lambda: 2)
    assert err.value.status == 429
    assert await offload.run(0, lambda: 3, always=False) == 3  # small: inline, not queued
    release.set()
    assert await job == 1
    offload.close()
