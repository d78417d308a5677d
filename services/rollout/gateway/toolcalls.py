"""Qwen / Hermes tool calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` in the model's text.

The parser is incremental (streaming feeds it deltas, non-streaming feeds the whole text at once) and its
events do not depend on how the text was cut into deltas, so both modes return the same message.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

from services.rollout.gateway.messages import ToolCall, ToolChoice

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclasses.dataclass(frozen=True)
class TextEvent:
    text: str


@dataclasses.dataclass(frozen=True)
class ToolCallEvent:
    call: ToolCall


Event = TextEvent | ToolCallEvent


def forced_prefix(choice: ToolChoice) -> str:
    """Text appended to the prompt so that the model's continuation is a tool call (tool_choice required / named)."""
    if choice.mode == "required":
        return OPEN + '\n{"name": "'
    if choice.mode == "function":
        return OPEN + '\n{"name": ' + json.dumps(choice.name) + ', "arguments": '
    return ""


def parse_call(block: str, new_id: Callable[[], str]) -> ToolCall | None:
    """One `<tool_call>` body -> ToolCall, or None when it is not a well-formed call."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return ToolCall(id=new_id(), name=obj["name"], arguments=args)
    return ToolCall(id=new_id(), name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    """Splits text into text events and tool-call events; malformed blocks stay text."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self._new_id = new_id
        self._buf = ""
        self._inside = False

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            if not self._inside:
                idx = self._buf.find(OPEN)
                if idx < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    _text(events, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return events
                _text(events, self._buf[:idx])
                self._buf, self._inside = self._buf[idx + len(OPEN):], True
            else:
                idx = self._buf.find(CLOSE)
                if idx < 0:
                    return events
                block, self._buf, self._inside = self._buf[:idx], self._buf[idx + len(CLOSE):], False
                call = parse_call(block, self._new_id)
                events.append(ToolCallEvent(call) if call else TextEvent(OPEN + block + CLOSE))

    def finish(self) -> list[Event]:
        """End of text: an unterminated block is a call if its JSON is complete, else text."""
        events: list[Event] = []
        if self._inside:
            call = parse_call(self._buf, self._new_id)
            events.append(ToolCallEvent(call) if call else TextEvent(OPEN + self._buf))
        else:
            _text(events, self._buf)
        self._buf, self._inside = "", False
        return events


class Trim:
    """Drops whitespace at the start and end of the text events (held back until more text shows it is inner)."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def apply(self, events: list[Event], final: bool = False) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, ToolCallEvent):
                out.append(event)
                continue
            text = event.text
            if not self._started:
                text = text.lstrip()
                if not text:
                    continue
                self._started = True
            text = self._held + text
            body = text.rstrip()
            self._held = text[len(body):]
            if body:
                out.append(TextEvent(body))
        if final:
            self._held = ""
        return out


def _text(events: list[Event], text: str) -> None:
    if text:
        events.append(TextEvent(text))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
