"""Anthropic Messages: request bodies -> GenRequest, and Message bodies / stream events from a Completion."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from services.rollout.gateway import fields as f
from services.rollout.gateway.errors import bad_request, unsupported
from services.rollout.gateway.images import IMAGE_MARK, check_text, from_base64_source
from services.rollout.gateway.messages import GenRequest, Message, Tool, ToolCall, ToolChoice
from services.rollout.gateway.runs import Completion, Run
from services.rollout.gateway.toolcalls import TextEvent, ToolCallEvent

_KNOWN = frozenset({"model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences",
                    "stream", "tools", "tool_choice", "metadata", "thinking", "service_tier", "container", "mcp_servers",
                    "context_management", "inference_geo", "output_config"})
_STOP = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}


def parse_messages(body: dict, *, strict: bool) -> GenRequest:
    f.check_keys(body, _KNOWN, frozenset(), strict=strict)
    for key in ("container", "mcp_servers"):
        f.reject_if(body, key, lambda v: False, f"{key} is not supported")
    f.reject_if(body, "thinking", lambda v: isinstance(v, dict) and v.get("type") == "disabled",
                "extended thinking is not supported by this policy; omit thinking or set {\"type\": \"disabled\"}")
    req = GenRequest(api="messages", model=f.string(body, "model", allow_empty=False))
    req.max_tokens = f.integer(body, "max_tokens", default=None, lo=1)
    if req.max_tokens is None:
        raise bad_request("max_tokens", "field required")
    req.temperature = f.number(body, "temperature", default=1.0, lo=0.0, hi=1.0)
    req.top_p = f.number(body, "top_p", default=1.0, lo=0.0, hi=1.0, lo_open=True)
    req.top_k = f.integer(body, "top_k", default=0, lo=0)
    stops = f.array(body, "stop_sequences", default=[])
    if not all(isinstance(s, str) for s in stops):
        raise bad_request("stop_sequences", "expected an array of strings")
    req.stop = [s for s in stops if s]
    req.stream = f.boolean(body, "stream")
    req.tools = _tools(body.get("tools"))
    req.tool_choice = _tool_choice(body.get("tool_choice"), req.tools)
    system = _system(body.get("system"))
    msgs = [Message(role="system", content=system)] if system else []
    for i, m in enumerate(f.array(body, "messages", non_empty=True)):
        msgs += _message(m, f"messages[{i}]")
    req.messages = msgs
    return req


def _system(value) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(f.string(f.obj(b, f"system[{j}]"), "text", f"system[{j}]") for j, b in enumerate(value))
    raise bad_request("system", "expected a string or an array of text blocks")


def _message(m, path: str) -> list[Message]:
    m = f.obj(m, path)
    role = f.string(m, "role", path)
    if role not in ("user", "assistant"):
        raise bad_request(f"{path}.role", f"expected 'user' or 'assistant', got {role!r}")
    content = f.req(m, "content", path)
    if isinstance(content, str):
        return [Message(role=role, content=check_text(content, f"{path}.content"))]
    if not isinstance(content, list):
        raise bad_request(f"{path}.content", "expected a string or an array of content blocks")
    out: list[Message] = []
    text: list[str] = []
    images: list[bytes] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(content):
        where = f"{path}.content[{j}]"
        block = f.obj(block, where)
        kind = block.get("type")
        if kind == "text":
            text.append(check_text(f.string(block, "text", where), f"{where}.text"))
        elif kind == "image" and role == "user":
            images.append(from_base64_source(block.get("source"), f"{where}.source"))
            text.append(IMAGE_MARK)
        elif kind == "tool_use" and role == "assistant":
            args = block.get("input", {})
            calls.append(ToolCall(id=f.string(block, "id", where), name=f.string(block, "name", where),
                                  arguments=json.dumps(f.obj(args, f"{where}.input"))))
        elif kind == "tool_result" and role == "user":
            if text:
                out.append(Message(role="user", content="".join(text), images=tuple(images)))
                text, images = [], []
            out.append(Message(role="tool", content=_result_text(block.get("content"), f"{where}.content"),
                               tool_call_id=f.string(block, "tool_use_id", where)))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not part of the rendered history
        else:
            raise unsupported(f"{where}.type", f"content block {kind!r} is not supported here")
    if role == "assistant":
        out.append(Message(role="assistant", content="".join(text), tool_calls=tuple(calls)))
    elif text or not out:
        out.append(Message(role="user", content="".join(text), images=tuple(images)))
    return out


def _result_text(value, path: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, b in enumerate(value):
            b = f.obj(b, f"{path}[{j}]")
            if b.get("type") != "text":
                raise unsupported(f"{path}[{j}].type", f"tool result block {b.get('type')!r} is not supported")
            parts.append(f.string(b, "text", f"{path}[{j}]"))
        return "".join(parts)
    raise bad_request(path, "expected a string or an array of text blocks")


def _tools(value) -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("tools", "expected an array")
    tools = []
    for i, t in enumerate(value):
        t = f.obj(t, f"tools[{i}]")
        if t.get("type") not in (None, "custom"):
            raise unsupported(f"tools[{i}].type", f"server tool {t.get('type')!r} is not supported; only client tools")
        schema = f.obj(t.get("input_schema", {}), f"tools[{i}].input_schema")
        tools.append(Tool(name=f.string(t, "name", f"tools[{i}]", allow_empty=False),
                          description=f.string(t, "description", f"tools[{i}]", default=""), parameters=schema))
    return tools


def _tool_choice(value, tools: list[Tool]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto")
    value = f.obj(value, "tool_choice")
    kind = value.get("type")
    if kind == "auto" or kind == "none":
        return ToolChoice(kind)
    if kind == "any":
        if not tools:
            raise bad_request("tool_choice", "'any' needs at least one tool in tools")
        return ToolChoice("required")
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or name not in {t.name for t in tools}:
            raise bad_request("tool_choice.name", f"{name!r} is not one of the tools")
        return ToolChoice("function", name)
    raise bad_request("tool_choice.type", f"expected auto, any, tool or none; got {kind!r}")


# responses ----------------------------------------------------------------------------------------------------
def usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0, "cache_creation": {"ephemeral_1h_input_tokens": 0, "ephemeral_5m_input_tokens": 0},
            "inference_geo": None, "output_tokens_details": {"thinking_tokens": 0}, "server_tool_use": None,
            "service_tier": "standard"}


def _text_block(text: str) -> dict:
    return {"type": "text", "text": text, "citations": None}


def _tool_block(call: ToolCall, input_: dict) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": input_, "caller": {"type": "direct"}}


def _blocks(c: Completion) -> list[dict]:
    ch = c.choices[0]
    blocks: list[dict] = [_text_block(ch.content)] if ch.content or not ch.tool_calls else []
    return blocks + [_tool_block(t, _input(t)) for t in ch.tool_calls]


def _input(call: ToolCall) -> dict:
    value = call.arguments_value()
    return value if isinstance(value, dict) else {"arguments": value}


def message_response(c: Completion) -> dict:
    ch = c.choices[0]
    return {"id": c.id, "type": "message", "role": "assistant", "model": c.model, "content": _blocks(c),
            "stop_reason": "stop_sequence" if ch.stop_sequence else _STOP[ch.finish_reason],
            "stop_sequence": ch.stop_sequence, "stop_details": None, "container": None,
            "usage": usage(c.prompt_tokens, c.completion_tokens)}


def event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n".encode()


async def message_stream(run: Run, model: str) -> AsyncIterator[bytes]:
    start = {"id": run.id, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
             "stop_sequence": None, "stop_details": None, "container": None, "usage": usage(len(run.prompt.ids), 0)}
    yield event("message_start", {"message": start})
    yield event("ping", {})
    index, open_text = -1, False
    async for _, events in run.deltas():
        for ev in events:
            if isinstance(ev, TextEvent):
                if not open_text:
                    index, open_text = index + 1, True
                    yield event("content_block_start", {"index": index, "content_block": _text_block("")})
                yield event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": ev.text}})
            elif isinstance(ev, ToolCallEvent):
                if open_text:
                    yield event("content_block_stop", {"index": index})
                    open_text = False
                index += 1
                call = ev.call
                yield event("content_block_start", {"index": index, "content_block": _tool_block(call, {})})
                yield event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(_input(call))}})
                yield event("content_block_stop", {"index": index})
    c = run.completion
    if index < 0:  # nothing generated: one empty text block, like the non-streaming body
        index, open_text = 0, True
        yield event("content_block_start", {"index": 0, "content_block": _text_block("")})
    if open_text:
        yield event("content_block_stop", {"index": index})
    ch = c.choices[0]
    yield event("message_delta", {"delta": {"stop_reason": "stop_sequence" if ch.stop_sequence else _STOP[ch.finish_reason],
                                            "stop_sequence": ch.stop_sequence, "stop_details": None},
                                  "usage": {"input_tokens": c.prompt_tokens, "output_tokens": c.completion_tokens,
                                            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}})
    yield event("message_stop", {})
