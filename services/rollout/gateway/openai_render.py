"""OpenAI response bodies and stream chunks (chat completions, completions) from a Completion (pure)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from services.rollout.gateway.chat_format import ChatFormat
from services.rollout.gateway.messages import ToolCall
from services.rollout.gateway.outputs import ChoiceResult
from services.rollout.gateway.runs import Completion, Run
from services.rollout.gateway.toolcalls import ToolCallEvent


def sse(data: dict | str) -> bytes:
    return b"data: " + (data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))).encode() + b"\n\n"


def fingerprint(version: int) -> str:
    return f"meshrl-v{version}"


def usage(c: Completion) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": c.prompt.reused},
            "completion_tokens_details": {"reasoning_tokens": 0}}


def tool_call_dict(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def token_logprobs(fmt: ChatFormat, ch: ChoiceResult) -> list[dict]:
    out = []
    for token_id, lp in zip(ch.visible_ids, ch.logprobs, strict=False):
        text = fmt.token_text(token_id)
        out.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
    return out


# chat completions ------------------------------------------------------------------------------------------
def chat_response(c: Completion, fmt: ChatFormat, *, logprobs: bool) -> dict:
    choices = []
    for ch in c.choices:
        message: dict = {"role": "assistant", "content": ch.content if ch.content or not ch.tool_calls else None,
                         "refusal": None, "annotations": []}
        if ch.tool_calls:
            message["tool_calls"] = [tool_call_dict(t) for t in ch.tool_calls]
        choices.append({"index": ch.index, "message": message, "finish_reason": ch.finish_reason,
                        "logprobs": {"content": token_logprobs(fmt, ch), "refusal": None} if logprobs else None})
    return {"id": c.id, "object": "chat.completion", "created": c.created, "model": c.model,
            "system_fingerprint": fingerprint(c.version), "choices": choices, "usage": usage(c)}


async def chat_stream(run: Run, n: int, model: str, version: int, fmt: ChatFormat, *, logprobs: bool,
                      include_usage: bool) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict], **extra) -> bytes:
        body = {"id": run.id, "object": "chat.completion.chunk", "created": run.created, "model": model,
                "system_fingerprint": fingerprint(version), "choices": choices, **extra}
        if include_usage:
            body.setdefault("usage", None)
        return sse(body)

    calls = [0] * n
    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for i in range(n)])
    async for index, events in run.deltas():
        for event in events:
            if isinstance(event, ToolCallEvent):
                delta = {"tool_calls": [tool_call_dict(event.call, calls[index])]}
                calls[index] += 1
            else:
                delta = {"content": event.text}
            yield chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])
    c = run.completion
    for ch in c.choices:
        lp = {"content": token_logprobs(fmt, ch), "refusal": None} if logprobs else None
        yield chunk([{"index": ch.index, "delta": {}, "logprobs": lp, "finish_reason": ch.finish_reason}])
    if include_usage:
        yield chunk([], usage=usage(c))
    yield sse("[DONE]")


# completions ------------------------------------------------------------------------------------------------
def completion_logprobs(fmt: ChatFormat, ch: ChoiceResult) -> dict:
    tokens = [fmt.token_text(t) for t in ch.visible_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": ch.logprobs[:len(tokens)], "text_offset": offsets, "top_logprobs": None}


def completions_response(c: Completion, fmt: ChatFormat, *, logprobs: bool) -> dict:
    choices = [{"index": ch.index, "text": ch.content, "finish_reason": ch.finish_reason,
                "logprobs": completion_logprobs(fmt, ch) if logprobs else None} for ch in c.choices]
    u = usage(c)
    return {"id": c.id, "object": "text_completion", "created": c.created, "model": c.model,
            "system_fingerprint": fingerprint(c.version), "choices": choices,
            "usage": {k: u[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}


async def completions_stream(run: Run, model: str, fmt: ChatFormat, *, logprobs: bool,
                             include_usage: bool) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict], **extra) -> bytes:
        return sse({"id": run.id, "object": "text_completion", "created": run.created, "model": model,
                    "choices": choices, **extra})

    async for index, events in run.deltas():
        text = "".join(getattr(e, "text", "") for e in events)
        if text:
            yield chunk([{"index": index, "text": text, "logprobs": None, "finish_reason": None}])
    c = run.completion
    for ch in c.choices:
        lp = completion_logprobs(fmt, ch) if logprobs else None
        yield chunk([{"index": ch.index, "text": "", "logprobs": lp, "finish_reason": ch.finish_reason}])
    if include_usage:
        u = usage(c)
        yield chunk([], usage={k: u[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")})
    yield sse("[DONE]")
