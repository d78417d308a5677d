"""The gateway stops the engine when it no longer needs a sequence: a stop string matched, the client left
mid-stream, the request timed out. What it records stays exactly the ids sampled up to the cut."""

from __future__ import annotations

import time

import httpx
import pytest

from services.rollout.gateway.outputs import _tokens_covering
from services.trainer.models.tiny_qwen3 import padded_vocab_size
from tests.gateway.harness import GatewayServer
from tests.gateway.policies import RecordingEngine, ScriptedLM

TEXT = "one two three four STOP five six seven. "
MAX_TOKENS = 3000


def endless_engine(tok, step_s: float = 0.0) -> RecordingEngine:
    """A policy that never ends a turn: TEXT over and over, one token per step (each taking at least step_s)."""
    cycle = tok.encode(TEXT, add_special_tokens=False)

    def next_token(ctx: list[int]) -> int:
        time.sleep(step_s)
        return cycle[len(ctx) % len(cycle)]

    model = ScriptedLM(padded_vocab_size(tok), next_token)
    return RecordingEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_batch=8,
                           max_context=4096, seed=0)


@pytest.fixture(scope="module")
def gw(tok):
    server = GatewayServer(endless_engine(tok), tok, request_timeout_s=60).start()
    yield server
    server.stop()


def body(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "count"}], "max_tokens": MAX_TOKENS,
            "temperature": 1.0, **extra}


def headers(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def wait_finished(seq, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not seq.finish_reason and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_aborts_generation_and_records_the_ids_up_to_the_cut(gw, tok, stream):
    s = gw.start_session()
    before = gw.engine.stats.tokens_generated
    r = httpx.post(gw.url + "/v1/chat/completions", json=body(stop=["STOP"], stream=stream), headers=headers(s["api_key"]),
                   timeout=60)
    assert r.status_code == 200, r.text
    seq = gw.engine.submitted[-1]
    wait_finished(seq)
    assert seq.finish_reason == "abort", "the engine stopped the sequence"
    assert len(seq.output_ids) < MAX_TOKENS // 3 and gw.engine.stats.tokens_generated - before < MAX_TOKENS // 3, \
        "far short of max_tokens"
    (interaction,) = gw.gateway.sessions.by_key(s["api_key"]).interactions
    text = tok.decode(seq.output_ids)
    keep = _tokens_covering(seq.output_ids, text.index("STOP") + len("STOP"), tok.decode)
    assert interaction.output_ids == seq.output_ids[:keep] and interaction.finish_reason == "stop"
    assert interaction.logprobs == seq.logprobs[:keep] and interaction.versions == seq.versions[:keep]
    if not stream:
        message = r.json()["choices"][0]
        assert message["finish_reason"] == "stop" and "STOP" not in message["message"]["content"]


def test_a_client_leaving_mid_stream_aborts_generation_and_records_nothing(gw):
    s = gw.start_session()
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body(stream=True), headers=headers(s["api_key"]),
                      timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert next(line for line in lines if line).startswith("data: "), "a first delta: generation under way"
        seq = gw.engine.submitted[-1]
    wait_finished(seq)
    assert seq.finish_reason == "abort" and len(seq.output_ids) < MAX_TOKENS
    deadline = time.monotonic() + 10
    while gw.gateway.inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gw.gateway.inflight == 0
    assert gw.session_info(s["session_id"])["interactions"] == []


def test_a_request_timeout_aborts_generation(tok):
    # 1 ms a token: the 3000 tokens take at least 3 s, ten times the timeout, however fast the machine
    gw = GatewayServer(endless_engine(tok, step_s=0.001), tok, request_timeout_s=0.3).start()
    try:
        s = gw.start_session()
        r = httpx.post(gw.url + "/v1/chat/completions", json=body(), headers=headers(s["api_key"]),
                       timeout=60)
        assert r.status_code == 504, r.text
        seq = gw.engine.submitted[-1]
        wait_finished(seq)
        assert seq.finish_reason == "abort" and len(seq.output_ids) < MAX_TOKENS
        assert gw.session_info(s["session_id"])["interactions"] == []
    finally:
        gw.stop()
