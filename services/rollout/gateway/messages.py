"""The canonical conversation every API dialect is parsed into, and what the gateway asks the engine for."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def arguments_value(self) -> Any:
        """The parsed arguments (the text itself when it is not JSON)."""
        try:
            return json.loads(self.arguments)
        except (TypeError, ValueError, RecursionError):
            return self.arguments


@dataclasses.dataclass(frozen=True)
class Message:
    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    # a user's images, in order, each standing at an IMAGE_MARK in `content` (gateway/images.py)
    images: tuple[bytes, ...] = dataclasses.field(default=(), repr=False)

    def key(self) -> tuple:
        """What identifies a message when an agent sends its history back: ids and whitespace at the ends don't count;
        the images do (the same words about another picture are another message)."""
        calls = tuple((c.name, _canonical_json(c.arguments)) for c in self.tool_calls)
        if not self.images:
            return (self.role, self.content.strip(), calls)
        return (self.role, self.content.strip(), calls, tuple(hashlib.sha256(b).hexdigest() for b in self.images))


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict = dataclasses.field(default_factory=dict)

    def openai_dict(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None


@dataclasses.dataclass(kw_only=True)
class GenRequest:
    """One generation request, whatever API it came from."""

    api: Literal["chat", "completions", "responses", "messages"]
    model: str
    messages: list[Message] | None = None           # chat-style APIs
    prompt: str | list[int] | None = None           # /v1/completions
    tools: list[Tool] = dataclasses.field(default_factory=list)
    tool_choice: ToolChoice = ToolChoice()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    n: int = 1
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    previous_response_id: str | None = None         # /v1/responses
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    echo_request: dict = dataclasses.field(default_factory=dict)  # request fields echoed in the response
    body_bytes: int = 0                             # the request body's size: large ones are rendered off the loop

    @property
    def parses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice.mode != "none"


def _canonical_json(text: str) -> str:
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        return text.strip() if isinstance(text, str) else repr(text)
