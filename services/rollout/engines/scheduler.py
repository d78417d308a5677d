"""Pure scheduling: which sequences form the running batch, and what a sampled token does to them.

No torch here, so the policy is testable without a model. Each step is a `Step`: either a prefill of
every row's full context (the first batch, or after a weight update made the KV cache stale), or a
decode of the rows kept from the previous batch plus a prefill of the rows admitted at its end, whose
KV is merged into the cache; running rows are never re-prefilled to admit new ones. Finished rows are
dropped from the cache when sequences are admitted or once they are half the batch. Ordinary work is
admitted when a quarter of the slots are free (fewer, larger prefills), priority work at the first free slot.

`abort(seq)` withdraws one sequence: a waiting one leaves its queue at once; a running one keeps its row
until the next `postprocess`, which finishes it with reason "abort" and appends nothing more to it.
A model step that fails ends only the rows it fails on (`fail_rows`, reason "error"); the others go on.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from services.common.errors import FieldError
from services.rollout.engines.sequence import Sequence, Status


@dataclasses.dataclass(frozen=True)
class Step:
    rows: list[Sequence]        # the batch after this step, in KV-cache row order
    prefill: bool               # True: rebuild every row's KV from its full context
    keep: tuple[int, ...] = ()  # (decode) rows of the previous batch kept, in order; they decode one token
    new: int = 0                # (decode) rows appended after them: prefilled and merged into the cache


class Scheduler:
    def __init__(self, *, max_batch: int, eos_token_id: int, max_context: int, refill_fraction: float = 0.25) -> None:
        assert max_batch > 0
        self.max_batch = max_batch
        self.eos_token_id = eos_token_id
        self.max_context = max_context
        self.refill_slots = max(1, int(max_batch * refill_fraction))
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.urgent: collections.deque[Sequence] = collections.deque()  # priority sequences, served first
        self.batch: list[Sequence] = []  # rows of the current KV cache, finished ones included
        self.aborting: set[Sequence] = set()  # running sequences the next postprocess finishes with "abort"
        self.stale = True

    def add(self, seq: Sequence) -> None:
        if len(seq.prompt_ids) >= self.max_context:
            raise FieldError("prompt_ids", f"{len(seq.prompt_ids)} tokens, the engine holds at most {self.max_context - 1}")
        (self.urgent if seq.priority else self.waiting).append(seq)

    @property
    def running(self) -> list[Sequence]:
        return [s for s in self.batch if s.status is Status.RUNNING]

    @property
    def num_waiting(self) -> int:
        return len(self.urgent) + len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.num_waiting) or any(s.status is Status.RUNNING for s in self.batch)

    def invalidate(self) -> None:
        """The weights changed: the next step must rebuild the KV cache."""
        self.stale = True

    def schedule(self) -> Step:
        running = self.running
        free = self.max_batch - len(running)
        admitted: list[Sequence] = []
        if self.stale or (self.urgent and free > 0) or (self.waiting and (free >= self.refill_slots or not running)):
            while self.num_waiting and len(running) + len(admitted) < self.max_batch:
                seq = (self.urgent or self.waiting).popleft()
                seq.status = Status.RUNNING
                admitted.append(seq)
        if self.stale or not running:
            self.batch = running + admitted
            self.stale = False
            return Step(self.batch, prefill=True)
        finished_rows = len(self.batch) - len(running)
        if finished_rows and (admitted or finished_rows * 2 >= len(self.batch)):
            keep = tuple(i for i, s in enumerate(self.batch) if s.status is Status.RUNNING)
        else:
            keep = tuple(range(len(self.batch)))
        self.batch = [self.batch[i] for i in keep] + admitted
        return Step(self.batch, prefill=False, keep=keep, new=len(admitted))

    def postprocess(self, rows: list[Sequence], tokens: list[int], logprobs: list[float], version: int) -> list[Sequence]:
        """Append each row's sampled token; returns the sequences that finished on this step."""
        assert len(rows) == len(tokens) == len(logprobs)
        done = []
        for seq, token, logprob in zip(rows, tokens, logprobs, strict=True):
            if seq.status is not Status.RUNNING:
                continue
            if seq in self.aborting:  # its token of this step is dropped: the ids stay as they were at abort()
                self.aborting.discard(seq)
                self._end(seq, "abort")
                done.append(seq)
                continue
            if not seq.output_ids:
                seq.first_token_at = time.perf_counter()
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            reason = self._finish_reason(seq, token)
            if reason:
                self._end(seq, reason)
                done.append(seq)
        return done

    def abort(self, seq: Sequence) -> bool:
        """Withdraw `seq`. True: it was waiting and is finished now (the caller reports it); False: it is
        running and the next postprocess finishes it, or it had already finished (nothing to do)."""
        if seq.status is Status.WAITING:
            queue = self.urgent if seq in self.urgent else self.waiting
            if seq in queue:
                queue.remove(seq)
                self._end(seq, "abort")
                return True
        elif seq.status is Status.RUNNING:
            self.aborting.add(seq)
        return False

    @staticmethod
    def _end(seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def _finish_reason(self, seq: Sequence, token: int) -> str:
        if (token == self.eos_token_id and not seq.sampling.ignore_eos) or token in seq.sampling.stop_token_ids:
            return "stop"
        if len(seq.output_ids) >= seq.sampling.max_new_tokens or len(seq.context) >= self.max_context:
            return "length"
        return ""

    def fail_rows(self, bad: list[Sequence]) -> list[Sequence]:
        """A model step failed because of these rows: end them with "error"; the other running rows stay and the
        next step rebuilds the KV cache without them. Returns the sequences ended."""
        ended = []
        for seq in bad:
            if seq.status is Status.RUNNING:
                self.aborting.discard(seq)
                self._end(seq, "error")
                ended.append(seq)
        self.batch = self.running
        self.stale = True
        return ended

    def fail_batch(self, reason: str = "abort") -> list[Sequence]:
        """The model step failed: end the running rows with `reason` (waiting work stays) and start afresh."""
        failed = self.running
        for seq in failed:
            self._end(seq, reason)
        self.aborting.clear()
        self.batch = []
        self.stale = True
        return failed

    def fail_all(self) -> list[Sequence]:
        """The engine cannot run any step: end every waiting and running sequence with "error"."""
        return self._end_all("error")

    def abort_all(self) -> list[Sequence]:
        """The engine stops: end every waiting and running sequence with "abort"."""
        return self._end_all("abort")

    def _end_all(self, reason: str) -> list[Sequence]:
        waiting = [*self.urgent, *self.waiting]
        self.urgent.clear()
        self.waiting.clear()
        for seq in waiting:
            self._end(seq, reason)
        return waiting + self.fail_batch(reason)
