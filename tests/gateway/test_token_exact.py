"""Exported token ids are exactly the sampled ids: the history is never re-tokenised from the assistant's text."""

from __future__ import annotations

import json

from anthropic import Anthropic
from openai import OpenAI

from services.rollout.gateway.chat_format import ChatFormat
from services.rollout.gateway.messages import Message, ToolCall
from tests.gateway.test_anthropic_sdk import CALCULATOR
from tests.gateway.test_openai_sdk import TOOLS


def calc(expression: str) -> str:
    a, b = expression.split("+")
    return str(int(a) + int(b))


def assert_exact(gw, sequences, traj) -> None:
    """prompt + completion = the last context; mask-1 tokens = all sampled ids, in order, with their log-probs."""
    last = sequences[-1]
    assert list(traj.prompt_ids) + list(traj.completion_ids) == last.prompt_ids + last.output_ids
    assert list(traj.prompt_ids) == sequences[0].prompt_ids
    for a, b in zip(sequences, sequences[1:], strict=False):
        assert b.prompt_ids[:len(a.prompt_ids) + len(a.output_ids)] == a.prompt_ids + a.output_ids
    sampled = [t for s in sequences for t in s.output_ids]
    masked = [t for t, m in zip(traj.completion_ids, traj.loss_mask, strict=True) if m]
    assert masked == sampled
    assert [lp for lp, m in zip(traj.behavior_logprobs, traj.loss_mask, strict=True) if m] == \
        [lp for s in sequences for lp in s.logprobs]
    assert [v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m] == [v for s in sequences for v in s.versions]
    assert all(v == -1 for v, m in zip(traj.versions, traj.loss_mask, strict=True) if not m)
    assert len(traj.completion_ids) == len(traj.loss_mask) == len(traj.versions) == len(traj.behavior_logprobs)


def test_five_turn_openai_tool_conversation_is_token_exact(scripted_gw, tok):
    s = scripted_gw.start_session(task_id="calc-5")
    before = len(scripted_gw.engine.submitted)
    c = OpenAI(base_url=scripted_gw.url + "/v1", api_key=s["api_key"], max_retries=0)
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "Add up, step by step."}]
    for _ in range(5):
        msg = c.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calc(json.loads(call.function.arguments)["expression"])})
    assert not msg.tool_calls and msg.content == "The answer is 9."
    assert scripted_gw.session_post(s["api_key"], "/rl/set_reward", {"reward": 1.0}).status_code == 200
    assert scripted_gw.session_post(s["api_key"], "/rl/end_session").json()["trajectories"] == 1
    (traj,) = [t for t in scripted_gw.published if t.work_id == s["session_id"]]
    sequences = scripted_gw.engine.submitted[before:]
    assert len(sequences) == 5 and traj.reward == 1.0 and traj.source == "gateway" and traj.scored
    assert_exact(scripted_gw, sequences, traj)
    # the chat template renders the calls differently from what was sampled: re-tokenising would not be exact
    fmt = ChatFormat(tok)
    rendered = fmt.encode(fmt.render(_canonical(messages[:-1]), _tools(), add_generation_prompt=True))
    assert rendered != sequences[-1].prompt_ids


def test_five_turn_anthropic_tool_conversation_is_token_exact(scripted_gw):
    s = scripted_gw.start_session(task_id="calc-5-anthropic")
    before = len(scripted_gw.engine.submitted)
    c = Anthropic(base_url=scripted_gw.url, api_key=s["api_key"], max_retries=0)
    messages = [{"role": "user", "content": "Add up, step by step."}]
    for _ in range(5):
        m = c.messages.create(model="c", max_tokens=300, tools=[CALCULATOR], messages=messages)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": calc(b.input["expression"])}
                   for b in m.content if b.type == "tool_use"]
        if not results:
            break
        messages.append({"role": "user", "content": results})
    scripted_gw.session_post(s["api_key"], "/rl/set_reward", {"reward": 0.5})
    scripted_gw.session_post(s["api_key"], "/rl/end_session")
    (traj,) = [t for t in scripted_gw.published if t.work_id == s["session_id"]]
    sequences = scripted_gw.engine.submitted[before:]
    assert len(sequences) == 5 and traj.reward == 0.5
    assert_exact(scripted_gw, sequences, traj)


def test_random_policy_five_turns_streaming_and_not_is_token_exact(random_gw):
    """Random text (special tokens, odd bytes, cut at max_tokens) still round-trips exactly through history."""
    s = random_gw.start_session(task_id="random-5")
    before = len(random_gw.engine.submitted)
    c = OpenAI(base_url=random_gw.url + "/v1", api_key=s["api_key"], max_retries=0)
    messages = [{"role": "user", "content": "Talk to me."}]
    for turn in range(5):
        if turn % 2:
            parts = list(c.chat.completions.create(model="m", messages=messages, max_tokens=24, stream=True))
            content = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        else:
            content = c.chat.completions.create(model="m", messages=messages, max_tokens=24).choices[0].message.content
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"turn {turn}"}]
    random_gw.session_post(s["api_key"], "/rl/end_session")
    (traj,) = [t for t in random_gw.published if t.work_id == s["session_id"]]
    sequences = random_gw.engine.submitted[before:]
    assert len(sequences) == 5
    assert_exact(random_gw, sequences, traj)


def _canonical(messages: list[dict]) -> list[Message]:
    out = []
    for m in messages:
        calls = tuple(ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", []))
        out.append(Message(role=m["role"], content=m.get("content") or "", tool_calls=calls,
                           tool_call_id=m.get("tool_call_id")))
    return out


def _tools():
    from services.rollout.gateway.openai_parse import parse_tools
    return parse_tools(TOOLS)
