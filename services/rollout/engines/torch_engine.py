"""The embedded engine: a Hugging Face causal LM generating on a background thread.

schedule -> execute -> postprocess, one step at a time. Generation is interruptible: `pause()`
returns once the loop stands between two steps; the caller may then change the weights in place
and call `resume(version)`; the next step rebuilds the KV cache under the new weights and every
later token carries the new version, while earlier tokens keep theirs. `abort(seq)` stops one sequence
(a client went away, a stop string ended it): it frees its slot, and its callback fires once, with
finish_reason "abort".
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from services.common.logging import get_logger
from services.rollout.engines.runner import ModelRunner
from services.rollout.engines.scheduler import Scheduler
from services.rollout.engines.sequence import Sampling, Sequence, Status


@dataclasses.dataclass(kw_only=True)
class EngineConfig:
    model_path: str = "artifacts/models/tiny-qwen3"
    max_batch: int = 64
    max_context: int = 512
    seed: int = 0
    torch_threads: int = 1
    initial_version: int = 0

    def build(self) -> EmbeddedEngine:
        if self.torch_threads > 0:
            torch.set_num_threads(self.torch_threads)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return EmbeddedEngine(model, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                              max_batch=self.max_batch, max_context=self.max_context, seed=self.seed,
                              version=self.initial_version)


@dataclasses.dataclass
class EngineStats:
    tokens_generated: int = 0
    sequences_finished: int = 0
    weight_updates: int = 0
    interrupted_sequences: int = 0
    sequences_aborted: int = 0
    steps: int = 0


class EmbeddedEngine:
    def __init__(self, model: PreTrainedModel, *, eos_token_id: int, pad_token_id: int, max_batch: int,
                 max_context: int, seed: int, version: int = 0) -> None:
        self.model = model
        self.version = version
        self.scheduler = Scheduler(max_batch=max_batch, eos_token_id=eos_token_id, max_context=max_context)
        self.runner = ModelRunner(model, pad_token_id=pad_token_id, seed=seed)
        self.stats = EngineStats()
        self._cv = threading.Condition()
        self._pause_requests = 0
        self._paused = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            aborted = self.scheduler.abort_all()
            self._count(aborted)
            for seq in aborted:
                self._finish(seq)
            self._cv.notify_all()
        self._thread.join(timeout=10)

    @property
    def paused(self) -> bool:
        return self._paused

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    # submission ----------------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], sampling: Sampling, on_finish, *, priority: bool = False) -> Sequence:
        seq = Sequence(prompt_ids=list(prompt_ids), sampling=sampling, on_finish=on_finish, priority=priority)
        with self._cv:
            if self._stopped:
                raise RuntimeError("engine stopped")
            self.scheduler.add(seq)
            self._cv.notify_all()
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop generating `seq` (any thread). Waiting: it leaves the queue now; running: the next step finishes
        it without appending another token. Either way its callback fires once, with finish_reason "abort";
        a sequence that already finished is left alone. From the moment this returns its ids no longer change."""
        with self._cv:
            if self._stopped:
                return
            now = self.scheduler.abort(seq)
            if now:
                self._count([seq])
            self._cv.notify_all()
        if now:
            self._finish(seq)

    async def generate(self, prompt_ids: list[int], sampling: Sampling, n: int = 1) -> list[Sequence]:
        """Submit n samples of one prompt and wait for all of them."""
        loop = asyncio.get_running_loop()
        futures = []
        for _ in range(n):
            fut = loop.create_future()
            futures.append(fut)
            self.submit(prompt_ids, sampling,
                        lambda seq, f=fut: loop.call_soon_threadsafe(_resolve, f, seq))
        return list(await asyncio.gather(*futures))

    # interruption ---------------------------------------------------------------------------------------
    def pause(self, timeout: float = 60.0) -> None:
        """Blocks until the loop stands between two steps; pauses nest."""
        with self._cv:
            self._pause_requests += 1
            self._cv.notify_all()
            if not self._cv.wait_for(lambda: self._paused or self._stopped, timeout=timeout):
                self._pause_requests -= 1
                raise TimeoutError(f"engine did not pause within {timeout}s")

    def resume(self, version: int | None = None) -> None:
        """Undo one pause; with `version`, the weights changed: rebuild the KV cache and tag later tokens."""
        with self._cv:
            if version is not None:
                if version != self.version:
                    self.stats.weight_updates += 1
                    self.stats.interrupted_sequences += len(self.scheduler.running)
                self.version = version
                self.scheduler.invalidate()
            self._pause_requests = max(0, self._pause_requests - 1)
            self._cv.notify_all()

    async def pause_async(self, timeout: float = 60.0) -> None:
        await asyncio.to_thread(self.pause, timeout)

    async def resume_async(self, version: int | None = None) -> None:
        self.resume(version)

    # the loop -----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (self._pause_requests or not self.scheduler.has_work()):
                    self._paused = self._pause_requests > 0
                    self._cv.notify_all()
                    self._cv.wait(timeout=1.0)
                self._paused = False
                if self._stopped:
                    return
                step = self.scheduler.schedule()
                rows, version = step.rows, self.version
            try:
                tokens, logprobs = self.runner.run(step)
            except Exception:  # a failed step must not take the engine down with every caller waiting on it
                get_logger().exception("engine_step_failed", rows=len(rows), prefill=step.prefill)
                self.runner.drop_cache()
                with self._cv:
                    failed = self.scheduler.fail_batch()
                    self._count(failed)
                for seq in failed:
                    self._finish(seq)
                continue
            with self._cv:
                active = sum(s.status is Status.RUNNING and s not in self.scheduler.aborting for s in rows)
                done = self.scheduler.postprocess(rows, tokens, logprobs, version)
                self.stats.steps += 1
                self.stats.tokens_generated += active
                self._count(done)
            for seq in done:
                self._finish(seq)

    def _count(self, done: list[Sequence]) -> None:  # under the lock
        self.stats.sequences_finished += len(done)
        self.stats.sequences_aborted += sum(s.finish_reason == "abort" for s in done)

    def _finish(self, seq: Sequence) -> None:
        if seq.on_finish:
            seq.on_finish(seq)


def _resolve(fut: asyncio.Future, seq: Sequence) -> None:
    if not fut.done():
        fut.set_result(seq)


