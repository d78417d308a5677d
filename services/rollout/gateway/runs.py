"""One request's generation: submitted sequences, their decoders, and the finished, replayable Completion."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable

from services.rollout.gateway.backend import Sampled
from services.rollout.gateway.errors import ApiError
from services.rollout.gateway.outputs import ChoiceDecoder, ChoiceResult
from services.rollout.gateway.tokens import Prompt
from services.rollout.gateway.toolcalls import Event, TextEvent, ToolCallEvent

END = object()


@dataclasses.dataclass
class Completion:
    id: str
    created: int
    model: str
    prompt: Prompt
    choices: list[ChoiceResult]
    version: int

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.output_ids) for c in self.choices)

    def events(self, index: int) -> list[Event]:
        """A finished choice as events (how a replay streams it)."""
        choice = self.choices[index]
        out: list[Event] = [TextEvent(choice.content)] if choice.content else []
        return out + [ToolCallEvent(c) for c in choice.tool_calls]


class Run:
    """Iterate `deltas()` for (choice index, events) as text arrives; then `completion` is set."""

    def __init__(self, completion_id: str, created: int, prompt: Prompt) -> None:
        self.id = completion_id
        self.created = created
        self.prompt = prompt
        self.completion: Completion | None = None

    async def deltas(self) -> AsyncIterator[tuple[int, list[Event]]]:
        raise NotImplementedError
        yield  # pragma: no cover

    async def finish(self) -> Completion:
        async for _ in self.deltas():
            pass
        assert self.completion is not None
        return self.completion

    def abandon(self) -> None:
        """The client went away before the end: stop generating; nothing is recorded."""


class ReplayRun(Run):
    """The first attempt's finished result, served again to an SDK retry."""

    def __init__(self, completion: Completion) -> None:
        super().__init__(completion.id, completion.created, completion.prompt)
        self.completion = completion

    async def deltas(self) -> AsyncIterator[tuple[int, list[Event]]]:
        for choice in self.completion.choices:
            yield choice.index, self.completion.events(choice.index)


class LiveRun(Run):
    """Sequences in the engine. A background task submits them and drives them to the end, even if the client
    goes away. Submitting from that task, after the request handler has done its work (for a stream: once its
    head has gone out and the client reads deltas), keeps the event loop quiet (and off the GIL) while the
    engine thread computes."""

    def __init__(self, completion_id: str, created: int, prompt: Prompt, submit: Callable[[], list[Sampled]],
                 decoders: list[ChoiceDecoder], *, stream: bool, poll_s: float, timeout_s: float,
                 finalize: Callable[[list[tuple[Sampled, ChoiceDecoder]]], Completion],
                 on_exit: Callable[[], None]) -> None:
        super().__init__(completion_id, created, prompt)
        self._submit = submit
        self._decoders = decoders
        self._pairs: list[tuple[Sampled, ChoiceDecoder]] = []
        self._snapshots = stream or any(d.needs_snapshots for d in decoders)
        self._queue: asyncio.Queue | None = asyncio.Queue() if stream else None
        self._reading = asyncio.Event()  # a stream's consumer has started reading deltas
        self._poll_s = poll_s
        self._deadline = time.monotonic() + timeout_s
        self._finalize = finalize
        self._on_exit = on_exit
        self.task = asyncio.create_task(self._drive(), name=f"gateway-run-{completion_id}")
        self.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even if nobody awaits

    async def deltas(self) -> AsyncIterator[tuple[int, list[Event]]]:
        if self._queue is None:
            self.completion = await asyncio.shield(self.task)
            return
        self._reading.set()
        while True:
            item = await self._queue.get()
            if item is END:
                break
            if isinstance(item, BaseException):
                raise item
            yield item
        self.completion = await asyncio.shield(self.task)

    def abandon(self) -> None:
        if not self.task.done():
            self.task.cancel()  # _drive aborts the sequences on its way out

    async def _drive(self) -> Completion:
        try:
            if self._queue is not None:  # the stream's head first, not in contention with the engine's prefill
                await asyncio.wait_for(self._reading.wait(), max(0.0, self._deadline - time.monotonic()))
            self._pairs = list(zip(self._submit(), self._decoders, strict=True))
            while True:
                waiting = [s.future for s, d in self._pairs if not d.finished and not s.done]
                if waiting:
                    left = self._deadline - time.monotonic()
                    if left <= 0:
                        raise ApiError(504, "generation did not finish within the gateway's request timeout")
                    await asyncio.wait(waiting, timeout=min(left, self._poll_s) if self._snapshots else left,
                                       return_when=asyncio.FIRST_COMPLETED)
                for s, d in self._pairs:
                    if not d.finished and (self._snapshots or s.done):
                        events = d.update(s.ids(), s.done)
                        if events and self._queue is not None:
                            self._queue.put_nowait((d.index, events))
                        if d.finished and not s.done:
                            s.abort()  # a stop string ended the text: the engine stops too, the ids stay as read
                if all(d.finished for _, d in self._pairs):
                    break
            completion = self._finalize(self._pairs)
            self.completion = completion
            return completion
        except BaseException as exc:
            for s, _ in self._pairs:  # a timeout, the client gone, an error: free the engine's slots
                s.abort()
            if self._queue is not None:
                self._queue.put_nowait(exc if isinstance(exc, Exception) else ApiError(503, "generation cancelled"))
            raise
        finally:
            self._on_exit()
            if self._queue is not None:
                self._queue.put_nowait(END)
