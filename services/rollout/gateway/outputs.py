"""From sampled token ids to what the client sees: text deltas, stop strings, tool calls, finish reasons.

`ChoiceDecoder.update(snapshot)` is called with a growing snapshot of one sequence's ids (streaming) or once
with the final ids (non-streaming); in both cases the events and the final `ChoiceResult` are the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from services.rollout.gateway.messages import Message, ToolCall
from services.rollout.gateway.toolcalls import Event, TextEvent, ToolCallEvent, ToolCallParser, Trim


@dataclasses.dataclass
class ChoiceResult:
    index: int
    output_ids: list[int]            # what is recorded: sampled ids, cut after a stop string if one was hit
    logprobs: list[float]
    versions: list[int]
    content: str
    tool_calls: list[ToolCall]
    finish_reason: str               # "stop", "length", "tool_calls"
    ended_on_stop_token: bool        # the last recorded id is an end-of-turn / eos token
    stop_sequence: str | None = None

    def message(self) -> Message:
        return Message(role="assistant", content=self.content, tool_calls=tuple(self.tool_calls))

    @property
    def visible_ids(self) -> list[int]:
        return self.output_ids[:-1] if self.ended_on_stop_token else self.output_ids


class ChoiceDecoder:
    def __init__(self, index: int, decode: Callable[[list[int]], str], *, stop: list[str], parse_tools: bool,
                 prefix_text: str, new_call_id: Callable[[], str]) -> None:
        self.index = index
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._parser = ToolCallParser(new_call_id) if parse_tools else None
        self._trim = Trim() if parse_tools else None
        self._emitted = 0                # chars of decoded text handed to the parser
        self._prefix_fed = not prefix_text
        self._prefix_text = prefix_text
        self.stop_hit: tuple[int, str] | None = None
        self.content_parts: list[str] = []
        self.tool_calls: list[ToolCall] = []
        self.finished = False

    @property
    def needs_snapshots(self) -> bool:
        """Stop strings are found in the text as it grows, so the sequence is watched while it runs."""
        return bool(self._stop)

    def update(self, ids: list[int], done: bool) -> list[Event]:
        """Feed the sequence's ids so far; returns the new events. After a stop string nothing more is emitted."""
        if self.finished:
            return []
        events: list[Event] = []
        if not self._prefix_fed:
            events += self._feed(self._prefix_text)
            self._prefix_fed = True
        text = self._decode(ids)
        if not done:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 character: wait for its other bytes
        hit = self._find_stop(text)
        if hit is not None:
            self.stop_hit = hit
            end, done = hit[0], True
        else:
            end = len(text) if done else max(self._emitted, len(text) - self._hold)
        if end > self._emitted:
            events += self._feed(text[self._emitted:end])
            self._emitted = end
        if done:
            events += self._finish()
        return events

    def result(self, ids: list[int], logprobs: list[float], versions: list[int], engine_finish: str,
               stop_token_ids: frozenset[int]) -> ChoiceResult:
        assert self.finished, "update(..., done=True) first"
        stop_sequence = None
        if self.stop_hit is not None:
            start, stop_sequence = self.stop_hit
            keep = _tokens_covering(ids, start + len(stop_sequence), self._decode)
            ids, logprobs, versions = ids[:keep], logprobs[:keep], versions[:keep]
            finish, on_stop = "stop", bool(ids) and ids[-1] in stop_token_ids
        else:
            finish = "length" if engine_finish == "length" else "stop"
            on_stop = engine_finish == "stop" and bool(ids) and ids[-1] in stop_token_ids
        if self.tool_calls and finish == "stop":
            finish = "tool_calls"
        return ChoiceResult(index=self.index, output_ids=list(ids), logprobs=list(logprobs), versions=list(versions),
                            content="".join(self.content_parts), tool_calls=list(self.tool_calls),
                            finish_reason=finish, ended_on_stop_token=on_stop, stop_sequence=stop_sequence)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        best = None
        for s in self._stop:
            idx = text.find(s, max(0, self._emitted - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        return best

    def _feed(self, text: str) -> list[Event]:
        events: list[Event] = self._parser.feed(text) if self._parser else [TextEvent(text)]
        return self._record(self._trim.apply(events) if self._trim else events)

    def _finish(self) -> list[Event]:
        self.finished = True
        events: list[Event] = self._parser.finish() if self._parser else []
        return self._record(self._trim.apply(events, final=True) if self._trim else events)

    def _record(self, events: list[Event]) -> list[Event]:
        for event in events:
            if isinstance(event, ToolCallEvent):
                self.tool_calls.append(event.call)
            else:
                self.content_parts.append(event.text)
        return events


def _tokens_covering(ids: list[int], n_chars: int, decode: Callable[[list[int]], str]) -> int:
    """The fewest leading ids whose text reaches `n_chars` characters."""
    lo, hi = 1, len(ids)
    while lo < hi:  # decoded length grows with the number of ids
        mid = (lo + hi) // 2
        if len(decode(ids[:mid]).rstrip("\ufffd")) >= n_chars:
            hi = mid
        else:
            lo = mid + 1
    return lo
