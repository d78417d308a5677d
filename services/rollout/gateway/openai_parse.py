"""OpenAI request bodies (chat completions, completions) -> GenRequest, with 400s that name the field."""

from __future__ import annotations

import json
from collections.abc import Collection

from services.rollout.gateway import fields as f
from services.rollout.gateway.config import TEMPLATE_KWARGS
from services.rollout.gateway.errors import bad_request, unsupported
from services.rollout.gateway.images import IMAGE_MARK, check_text, from_data_url
from services.rollout.gateway.messages import GenRequest, Message, Tool, ToolCall, ToolChoice

_COMMON_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "seed", "prompt_cache_key",
                             "safety_identifier", "prompt_cache_retention", "parallel_tool_calls", "reasoning_effort",
                             "verbosity", "modalities", "response_format", "logit_bias", "frequency_penalty",
                             "presence_penalty", "top_logprobs", "best_of", "echo", "suffix"})
_CHAT_KNOWN = frozenset({"model", "messages", "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens",
                         "n", "stop", "stream", "stream_options", "logprobs", "tools", "tool_choice", "chat_template_kwargs"})
_COMPLETIONS_KNOWN = frozenset({"model", "prompt", "temperature", "top_p", "top_k", "max_tokens", "n", "stop", "stream",
                                "stream_options", "logprobs"})


def sampling_fields(body: dict, req: GenRequest, *, max_n: int) -> None:
    req.temperature = f.number(body, "temperature", default=1.0, lo=0.0, hi=2.0)
    req.top_p = f.number(body, "top_p", default=1.0, lo=0.0, hi=1.0, lo_open=True)
    top_k = f.integer(body, "top_k", default=0, lo=-1)
    req.top_k = max(0, top_k)
    req.n = f.integer(body, "n", default=1, lo=1, hi=max_n)
    req.stop = f.stop_list(body, "stop")
    req.stream = f.boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        options = f.obj(options, "stream_options")
        req.include_usage = f.boolean(options, "include_usage", "stream_options")


def reject_unhonourable(body: dict) -> None:
    """Parameters that would change what is sampled or returned in ways the gateway cannot honour."""
    f.reject_if(body, "logit_bias", lambda v: not v, "logit_bias is not supported (the policy's distribution is trained as sampled)")
    f.reject_if(body, "frequency_penalty", lambda v: v == 0, "only 0 is supported")
    f.reject_if(body, "presence_penalty", lambda v: v == 0, "only 0 is supported")
    f.reject_if(body, "top_logprobs", lambda v: v == 0, "only 0 is supported (the engine reports the sampled token's log-prob)")
    f.reject_if(body, "best_of", lambda v: v == 1, "only 1 is supported")
    f.reject_if(body, "echo", lambda v: v is False, "only false is supported")
    f.reject_if(body, "suffix", lambda v: False, "suffix is not supported")
    f.reject_if(body, "response_format", lambda v: isinstance(v, dict) and v.get("type") == "text",
                "only {\"type\": \"text\"} is supported (no constrained decoding)")
    f.reject_if(body, "modalities", lambda v: v == ["text"], "only [\"text\"] is supported")
    for key in ("functions", "function_call", "audio", "prediction", "web_search_options"):
        f.reject_if(body, key, lambda v: False, f"{key} is not supported")


def parse_chat(body: dict, *, max_n: int, strict: bool, template_kwargs: Collection[str] = TEMPLATE_KWARGS) -> GenRequest:
    f.check_keys(body, _CHAT_KNOWN, _COMMON_IGNORED | {"functions", "function_call", "audio", "prediction",
                                                       "web_search_options", "reasoning"}, strict=strict)
    reject_unhonourable(body)
    req = GenRequest(api="chat", model=f.string(body, "model", allow_empty=False))
    req.messages = [parse_message(m, f"messages[{i}]") for i, m in enumerate(f.array(body, "messages", non_empty=True))]
    sampling_fields(body, req, max_n=max_n)
    req.max_tokens = f.integer(body, "max_completion_tokens", default=None, lo=1)
    if req.max_tokens is None:
        req.max_tokens = f.integer(body, "max_tokens", default=None, lo=1)
    req.logprobs = f.boolean(body, "logprobs")
    req.tools = parse_tools(body.get("tools"))
    req.tool_choice = parse_tool_choice(body.get("tool_choice"), req.tools)
    req.template_kwargs = parse_template_kwargs(body.get("chat_template_kwargs"), template_kwargs)
    return req


def parse_template_kwargs(value, allowed: Collection[str]) -> dict:
    """Only the documented switches of the model's template (e.g. enable_thinking), each a boolean; a template or
    anything that changes how it is applied is never taken from a request."""
    if value is None:
        return {}
    value = f.obj(value, "chat_template_kwargs")
    for key, item in value.items():
        if key not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            raise unsupported(f"chat_template_kwargs.{key}", f"is not an accepted template option (accepted: {known})")
        if not isinstance(item, bool):
            raise bad_request(f"chat_template_kwargs.{key}", "expected true or false")
    return dict(value)


def parse_completions(body: dict, *, max_n: int, strict: bool) -> GenRequest:
    f.check_keys(body, _COMPLETIONS_KNOWN, _COMMON_IGNORED, strict=strict)
    reject_unhonourable(body)
    req = GenRequest(api="completions", model=f.string(body, "model", allow_empty=False))
    req.prompt = _prompt(f.req(body, "prompt"))
    sampling_fields(body, req, max_n=max_n)
    req.max_tokens = f.integer(body, "max_tokens", default=16, lo=1)
    logprobs = f.integer(body, "logprobs", default=None, lo=0)
    if logprobs not in (None, 0):
        raise unsupported("logprobs", "only 0 is supported (the engine reports the sampled token's log-prob)")
    req.logprobs = logprobs == 0
    return req


def _prompt(value) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        return list(value)
    raise bad_request("prompt", "expected a string or an array of token ids (batches of several prompts are not supported)")


def parse_message(m, path: str) -> Message:
    m = f.obj(m, path)
    role = f.string(m, "role", path)
    role = {"developer": "system"}.get(role, role)
    if role not in ("system", "user", "assistant", "tool"):
        raise bad_request(f"{path}.role", f"expected one of system, developer, user, assistant, tool; got {role!r}")
    content, images = _content(m.get("content"), f"{path}.content", required=role != "assistant", images=role == "user")
    calls: tuple[ToolCall, ...] = ()
    if role == "assistant" and m.get("tool_calls"):
        calls = tuple(_tool_call(c, f"{path}.tool_calls[{j}]") for j, c in enumerate(f.array(m, "tool_calls", path)))
    tool_call_id = f.string(m, "tool_call_id", path, default=None) if role == "tool" else None
    return Message(role=role, content=content, tool_calls=calls, tool_call_id=tool_call_id,
                   name=f.string(m, "name", path, default=None), images=images)


def _content(value, path: str, *, required: bool, images: bool) -> tuple[str, tuple[bytes, ...]]:
    """The text, with IMAGE_MARK where each image part stood, and the images' bytes (`images`: the role may send
    images: a user's message)."""
    if value is None:
        if required:
            raise bad_request(path, "field required")
        return "", ()
    if isinstance(value, str):
        return check_text(value, path), ()
    if not isinstance(value, list):
        raise bad_request(path, "expected a string or an array of content parts")
    parts, blobs = [], []
    for j, part in enumerate(value):
        part = f.obj(part, f"{path}[{j}]")
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text"):
            parts.append(check_text(f.string(part, "text", f"{path}[{j}]"), f"{path}[{j}].text"))
        elif kind == "refusal":
            parts.append(f.string(part, "refusal", f"{path}[{j}]"))
        elif kind == "image_url" and images:
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            blobs.append(from_data_url(url, f"{path}[{j}].image_url.url"))
            parts.append(IMAGE_MARK)
        else:
            raise unsupported(f"{path}[{j}].type", f"content type {kind!r} is not supported here")
    return "".join(parts), tuple(blobs)


def _tool_call(c, path: str) -> ToolCall:
    c = f.obj(c, path)
    if c.get("type", "function") != "function":
        raise unsupported(f"{path}.type", "only function tool calls are supported")
    fn = f.obj(f.req(c, "function", path), f"{path}.function")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args)
    return ToolCall(id=f.string(c, "id", path, default=""), name=f.string(fn, "name", f"{path}.function"), arguments=args)


def parse_tools(value, path: str = "tools") -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request(path, "expected an array")
    tools = []
    for i, t in enumerate(value):
        t = f.obj(t, f"{path}[{i}]")
        if t.get("type", "function") != "function":
            raise unsupported(f"{path}[{i}].type", f"tool type {t.get('type')!r} is not supported; only function tools")
        fn = f.obj(t["function"], f"{path}[{i}].function") if "function" in t else t  # chat nests, responses doesn't
        where = f"{path}[{i}].function" if "function" in t else f"{path}[{i}]"
        params = fn.get("parameters") or {}
        tools.append(Tool(name=f.string(fn, "name", where, allow_empty=False),
                          description=f.string(fn, "description", where, default="") or "",
                          parameters=f.obj(params, f"{where}.parameters")))
    return tools


def parse_tool_choice(value, tools: list[Tool], path: str = "tool_choice") -> ToolChoice:
    if value is None or value == "auto":
        return ToolChoice("auto")
    if value in ("none", "required"):
        if value == "required" and not tools:
            raise bad_request(path, "'required' needs at least one tool in tools")
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function", value)
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in {t.name for t in tools}:
            raise bad_request(f"{path}.function.name", f"{name!r} is not one of the tools")
        return ToolChoice("function", name)
    if isinstance(value, dict) and value.get("type") == "allowed_tools":
        raise unsupported(path, "allowed_tools is not supported")
    raise bad_request(path, "expected 'auto', 'none', 'required' or {\"type\": \"function\", ...}")
