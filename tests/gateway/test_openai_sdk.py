"""The official openai SDK against a running gateway: sync, async, streaming, tools, completions, responses."""

from __future__ import annotations

import json

import pytest
from openai import AsyncOpenAI, OpenAI

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                                            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                           "required": ["expression"]}}}]


def client(gw, key: str) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def test_sync_chat_is_recorded_with_usage_and_logprobs(random_gw):
    s = random_gw.start_session()
    r = client(random_gw, s["api_key"]).chat.completions.create(
        model="anything", messages=[{"role": "user", "content": "Say hi."}], max_tokens=12, logprobs=True)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    assert len(choice.logprobs.content) in (r.usage.completion_tokens, r.usage.completion_tokens - 1)
    assert all(lp.logprob <= 0 for lp in choice.logprobs.content)
    info = random_gw.session_info(s["session_id"])
    assert [i["id"] for i in info["interactions"]] == [r.id]


def test_sync_stream_matches_recorded_tokens(random_gw, tok):
    s = random_gw.start_session()
    stream = client(random_gw, s["api_key"]).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Count."}], max_tokens=20, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    assert len(finish) == 1 and len(usage) == 1 and usage[0].completion_tokens <= 20
    seq = random_gw.engine.submitted[-1]
    assert text == tok.decode(seq.output_ids[:usage[0].completion_tokens], skip_special_tokens=True)


def test_stream_and_non_stream_give_the_same_message(scripted_gw):
    s = scripted_gw.start_session()
    c = client(scripted_gw, s["api_key"])
    body = {"model": "m", "messages": [{"role": "user", "content": "What is 1+2?"}], "tools": TOOLS}
    whole = c.chat.completions.create(**body).choices[0]
    parts = list(c.chat.completions.create(**body, stream=True))
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    calls = [tc for p in parts if p.choices for tc in (p.choices[0].delta.tool_calls or [])]
    assert text == whole.message.content == "Let me check."
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == \
        [(tc.function.name, tc.function.arguments) for tc in whole.message.tool_calls]
    assert parts[-1].choices[0].finish_reason == whole.finish_reason == "tool_calls"
    a, b = scripted_gw.engine.submitted[-2:]
    assert a.output_ids == b.output_ids


def test_tool_calls_are_parsed_into_openai_tool_calls(scripted_gw):
    s = scripted_gw.start_session()
    r = client(scripted_gw, s["api_key"]).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What is 1+2?"}], tools=TOOLS)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.type == "function" and call.function.name == "calculator" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"expression": "1+2"}


def test_tool_choice_required_forces_a_call(scripted_gw):
    s = scripted_gw.start_session()
    weather = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = client(scripted_gw, s["api_key"]).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hello"}], tools=weather, tool_choice="required")
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    named = client(scripted_gw, s["api_key"]).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hello"}], tools=weather,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.choices[0].message.tool_calls[0].function.arguments) == {"location": "San Francisco"}


def test_n_samples_and_stop_strings(random_gw, tok):
    s = random_gw.start_session()
    r = client(random_gw, s["api_key"]).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], n=3, max_tokens=30, stop=["a", "e"])
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert "a" not in (c.message.content or "") and "e" not in (c.message.content or "")
    info = random_gw.session_info(s["session_id"])
    assert len(info["interactions"]) == 3 and info["interactions"][1]["id"] == f"{r.id}-1"


async def test_async_chat_and_stream(random_gw):
    s = random_gw.start_session()
    c = AsyncOpenAI(base_url=random_gw.url + "/v1", api_key=s["api_key"], max_retries=0)
    r = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert r.choices[0].message.role == "assistant"
    stream = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                             stream=True)
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason in ("stop", "length")
    await c.close()


def test_completions_models_and_token_prompts(random_gw, tok):
    s = random_gw.start_session()
    c = client(random_gw, s["api_key"])
    assert [m.id for m in c.models.list()] == ["meshrl-policy"]
    first = c.completions.create(model="m", prompt="The sky is", max_tokens=6)
    assert first.object == "text_completion" and first.choices[0].finish_reason in ("stop", "length")
    ids = random_gw.engine.submitted[-1].prompt_ids + random_gw.engine.submitted[-1].output_ids
    second = c.completions.create(model="m", prompt=ids + [32], max_tokens=4, logprobs=0)
    assert len(second.choices[0].logprobs.token_logprobs) >= 1
    streamed = list(c.completions.create(model="m", prompt="abc", max_tokens=4, stream=True))
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")
    info = random_gw.session_info(s["session_id"])
    assert info["interactions"][1]["parent_id"] == info["interactions"][0]["id"]


def test_responses_api_text_tools_stream_and_previous_response(scripted_gw):
    s = scripted_gw.start_session()
    c = client(scripted_gw, s["api_key"])
    r = c.responses.create(model="m", input="Hello")
    assert r.status == "completed" and r.output_text == "Hello there, friend!"
    tools = [{"type": "function", "name": "calculator", "parameters": TOOLS[0]["function"]["parameters"]}]
    r1 = c.responses.create(model="m", input="What is 1+2?", tools=tools)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert calls and calls[0].name == "calculator"
    r2 = c.responses.create(model="m", previous_response_id=r1.id, tools=tools,
                            input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "3"}])
    assert r2.output_text.startswith("Let me check") or "3" in r2.output_text
    with c.responses.stream(model="m", input="Hello") as stream:
        final = stream.get_final_response()
    assert final.output_text == "Hello there, friend!"
    info = scripted_gw.session_info(s["session_id"])
    assert info["interactions"][2]["parent_id"] == info["interactions"][1]["id"]


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_routes_answer_with_and_without_v1(random_gw, prefix):
    s = random_gw.start_session()
    c = OpenAI(base_url=random_gw.url + prefix, api_key=s["api_key"], max_retries=0)
    assert c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2).choices
