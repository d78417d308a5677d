"""OpenAI Responses: request bodies -> GenRequest, and response objects / stream events from a Completion."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from services.rollout.gateway import fields as f
from services.rollout.gateway.errors import bad_request, unsupported
from services.rollout.gateway.messages import GenRequest, Message, ToolCall
from services.rollout.gateway.openai_parse import parse_message, parse_tool_choice, parse_tools
from services.rollout.gateway.runs import Completion, Run
from services.rollout.gateway.toolcalls import TextEvent, ToolCallEvent

_KNOWN = frozenset({"model", "input", "instructions", "tools", "tool_choice", "temperature", "top_p", "max_output_tokens",
                    "stream", "previous_response_id", "store", "metadata", "parallel_tool_calls", "user", "truncation",
                    "text", "reasoning", "service_tier", "safety_identifier", "prompt_cache_key", "include",
                    "background", "max_tool_calls", "top_logprobs", "stream_options", "conversation", "prompt"})


def parse_responses(body: dict, *, strict: bool) -> GenRequest:
    f.check_keys(body, _KNOWN, frozenset(), strict=strict)
    f.reject_if(body, "background", lambda v: v is False, "background responses are not supported")
    f.reject_if(body, "conversation", lambda v: False, "conversation objects are not supported; use previous_response_id")
    f.reject_if(body, "prompt", lambda v: False, "prompt templates are not supported")
    f.reject_if(body, "top_logprobs", lambda v: v == 0, "only 0 is supported")
    f.reject_if(body, "text", _text_format, "only text output is supported (no constrained decoding)")
    req = GenRequest(api="responses", model=f.string(body, "model", allow_empty=False))
    req.temperature = f.number(body, "temperature", default=1.0, lo=0.0, hi=2.0)
    req.top_p = f.number(body, "top_p", default=1.0, lo=0.0, hi=1.0, lo_open=True)
    req.max_tokens = f.integer(body, "max_output_tokens", default=None, lo=1)
    req.stream = f.boolean(body, "stream")
    req.tools = parse_tools(body.get("tools"))
    req.tool_choice = parse_tool_choice(body.get("tool_choice"), req.tools)
    req.previous_response_id = f.string(body, "previous_response_id", default=None)
    instructions = f.string(body, "instructions", default=None)
    msgs = [Message(role="system", content=instructions)] if instructions else []
    req.messages = msgs + _items(f.req(body, "input"))
    if not req.messages:
        raise bad_request("input", "must not be empty")
    req.echo_request = {k: body.get(k) for k in ("instructions", "metadata", "previous_response_id", "tool_choice")}
    req.echo_request["tools"] = [{"type": "function", "name": t.name, "description": t.description,
                                  "parameters": t.parameters, "strict": False} for t in req.tools]
    return req


def _text_format(value) -> bool:
    fmt = value.get("format", {"type": "text"}) if isinstance(value, dict) else None
    return isinstance(fmt, dict) and fmt.get("type") == "text"


def _items(value) -> list[Message]:
    if isinstance(value, str):
        return [Message(role="user", content=value)]
    if not isinstance(value, list):
        raise bad_request("input", "expected a string or an array of input items")
    out: list[Message] = []
    for i, item in enumerate(value):
        path = f"input[{i}]"
        item = f.obj(item, path)
        kind = item.get("type", "message")
        if kind == "message":
            msg = parse_message(item, path)
            if msg.role == "tool":
                raise bad_request(f"{path}.role", "use a function_call_output item for tool results")
            out.append(msg)
        elif kind == "function_call":
            call = ToolCall(id=f.string(item, "call_id", path), name=f.string(item, "name", path),
                            arguments=f.string(item, "arguments", path))
            if out and out[-1].role == "assistant":  # an assistant message and its calls are one turn
                last = out.pop()
                out.append(Message(role="assistant", content=last.content, tool_calls=(*last.tool_calls, call)))
            else:
                out.append(Message(role="assistant", tool_calls=(call,)))
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output)
            out.append(Message(role="tool", content=output, tool_call_id=f.string(item, "call_id", path)))
        elif kind == "reasoning":
            continue
        else:
            raise unsupported(f"{path}.type", f"input item {kind!r} is not supported")
    return out


# responses ----------------------------------------------------------------------------------------------------
def _output(c: Completion) -> list[dict]:
    ch = c.choices[0]
    status = "incomplete" if ch.finish_reason == "length" else "completed"
    items: list[dict] = []
    if ch.content or not ch.tool_calls:
        items.append(_message_item(f"msg_{c.id[5:]}", ch.content, status))
    items += [_call_item(t, "completed") for t in ch.tool_calls]
    return items


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text is not None else []}


def _call_item(call: ToolCall, status: str) -> dict:
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def response_object(req: GenRequest, rid: str, created: int, model: str, c: Completion | None) -> dict:
    ch = c.choices[0] if c else None
    status = "in_progress" if ch is None else ("incomplete" if ch.finish_reason == "length" else "completed")
    echo = req.echo_request
    usage = None if c is None else {
        "input_tokens": c.prompt_tokens, "output_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
        "input_tokens_details": {"cached_tokens": c.prompt.reused}, "output_tokens_details": {"reasoning_tokens": 0}}
    choice = echo.get("tool_choice")
    return {"id": rid, "object": "response", "created_at": created,
            "completed_at": int(time.time()) if c is not None else None, "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": model, "previous_response_id": echo.get("previous_response_id"),
            "instructions": echo.get("instructions"), "output": _output(c) if c else [], "error": None,
            "tools": echo.get("tools", []), "tool_choice": choice if choice is not None else "auto", "truncation": "disabled",
            "parallel_tool_calls": True, "text": {"format": {"type": "text"}}, "top_p": req.top_p,
            "presence_penalty": 0, "frequency_penalty": 0, "top_logprobs": 0, "temperature": req.temperature,
            "reasoning": None, "usage": usage, "max_output_tokens": req.max_tokens, "max_tool_calls": None,
            "store": True, "background": False, "service_tier": "default", "metadata": echo.get("metadata") or {},
            "safety_identifier": None, "prompt_cache_key": None}


def _event(seq: list[int], kind: str, **data) -> bytes:
    seq[0] += 1
    body = {"type": kind, "sequence_number": seq[0], **data}
    return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


async def response_stream(req: GenRequest, run: Run, model: str) -> AsyncIterator[bytes]:
    seq = [-1]
    snapshot = response_object(req, run.id, run.created, model, None)
    yield _event(seq, "response.created", response=snapshot)
    yield _event(seq, "response.in_progress", response=snapshot)
    index, text_item, text = -1, None, ""
    async for _, events in run.deltas():
        for ev in events:
            if isinstance(ev, TextEvent):
                if text_item is None:
                    index += 1
                    text_item = f"msg_{run.id[5:]}" if index == 0 else f"msg_{run.id[5:]}_{index}"
                    yield _event(seq, "response.output_item.added", output_index=index,
                                 item=_message_item(text_item, None, "in_progress"))
                    yield _event(seq, "response.content_part.added", item_id=text_item, output_index=index,
                                 content_index=0, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                text += ev.text
                yield _event(seq, "response.output_text.delta", item_id=text_item, output_index=index, content_index=0,
                             delta=ev.text, logprobs=[])
            elif isinstance(ev, ToolCallEvent):
                if text_item is not None:
                    for b in _close_text(seq, text_item, index, text, "completed"):
                        yield b
                    text_item, text = None, ""
                index += 1
                item = _call_item(ev.call, "in_progress")
                yield _event(seq, "response.output_item.added", output_index=index, item={**item, "arguments": ""})
                yield _event(seq, "response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                             delta=ev.call.arguments)
                yield _event(seq, "response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             arguments=ev.call.arguments)
                yield _event(seq, "response.output_item.done", output_index=index, item={**item, "status": "completed"})
    c = run.completion
    status = "incomplete" if c.choices[0].finish_reason == "length" else "completed"
    if text_item is None and index < 0:
        index, text_item = 0, f"msg_{run.id[5:]}"
        yield _event(seq, "response.output_item.added", output_index=0, item=_message_item(text_item, None, "in_progress"))
        yield _event(seq, "response.content_part.added", item_id=text_item, output_index=0, content_index=0,
                     part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
    if text_item is not None:
        for b in _close_text(seq, text_item, index, text, status):
            yield b
    final = response_object(req, run.id, run.created, model, c)
    yield _event(seq, "response.completed" if status == "completed" else "response.incomplete", response=final)


def _close_text(seq: list[int], item_id: str, index: int, text: str, status: str) -> list[bytes]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return [_event(seq, "response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=text,
                   logprobs=[]),
            _event(seq, "response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part),
            _event(seq, "response.output_item.done", output_index=index, item={**_message_item(item_id, text, status)})]
