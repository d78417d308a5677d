"""The official anthropic SDK against a running gateway: sync, async, streaming, tool_use / tool_result."""

from __future__ import annotations

from anthropic import Anthropic, AsyncAnthropic

CALCULATOR = {"name": "calculator", "description": "Evaluate an arithmetic expression.",
              "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}


def client(gw, key: str) -> Anthropic:
    return Anthropic(base_url=gw.url, api_key=key, max_retries=0)


def test_sync_message_with_system_prompt(random_gw):
    s = random_gw.start_session()
    m = client(random_gw, s["api_key"]).messages.create(
        model="claude-x", max_tokens=10, system="Be brief.", messages=[{"role": "user", "content": "Hi"}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens <= 10
    assert m.content and m.content[0].type == "text"
    assert len(random_gw.session_info(s["session_id"])["interactions"]) == 1


def test_stream_text_equals_final_message(random_gw):
    s = random_gw.start_session()
    with client(random_gw, s["api_key"]).messages.stream(
            model="c", max_tokens=16, messages=[{"role": "user", "content": "Count"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in final.content if b.type == "text")
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens <= 16


def test_tool_use_and_tool_result_round_trip(scripted_gw):
    s = scripted_gw.start_session()
    c = client(scripted_gw, s["api_key"])
    messages = [{"role": "user", "content": "What is 1+2?"}]
    first = c.messages.create(model="c", max_tokens=200, tools=[CALCULATOR], messages=messages)
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses[0].name == "calculator" and uses[0].input == {"expression": "1+2"}
    assert uses[0].id.startswith("toolu_")
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "3"}]}]
    second = c.messages.create(model="c", max_tokens=200, tools=[CALCULATOR], messages=messages)
    info = scripted_gw.session_info(s["session_id"])
    assert info["interactions"][1]["parent_id"] == info["interactions"][0]["id"]
    assert second.content[0].type == "text" or second.stop_reason == "tool_use"


def test_streamed_tool_use_matches_non_streamed(scripted_gw):
    s = scripted_gw.start_session()
    c = client(scripted_gw, s["api_key"])
    body = {"model": "c", "max_tokens": 200, "tools": [CALCULATOR], "messages": [{"role": "user", "content": "1+2?"}]}
    whole = c.messages.create(**body)
    with c.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [b.model_dump(exclude={"id"}) for b in whole.content]
    assert final.stop_reason == whole.stop_reason == "tool_use"


def test_tool_choice_any_forces_tool_use(scripted_gw):
    s = scripted_gw.start_session()
    weather = {"name": "get_weather", "input_schema": {"type": "object"}}
    m = client(scripted_gw, s["api_key"]).messages.create(
        model="c", max_tokens=100, tools=[weather], tool_choice={"type": "any"}, messages=[{"role": "user", "content": "x"}])
    assert m.stop_reason == "tool_use" and m.content[-1].input == {"location": "San Francisco"}


async def test_async_create_stream_and_count_tokens(random_gw):
    s = random_gw.start_session()
    c = AsyncAnthropic(base_url=random_gw.url, api_key=s["api_key"], max_retries=0)
    m = await c.messages.create(model="c", max_tokens=6, messages=[{"role": "user", "content": "hey"}])
    assert m.usage.input_tokens > 0
    async with c.messages.stream(model="c", max_tokens=6, messages=[{"role": "user", "content": "hey"}]) as stream:
        final = await stream.get_final_message()
    assert final.usage.input_tokens == m.usage.input_tokens
    count = await c.messages.count_tokens(model="c", messages=[{"role": "user", "content": "hey"}])
    assert count.input_tokens == m.usage.input_tokens
    await c.close()
