"""The embedded engine: a Hugging Face causal LM generating on a background thread.

schedule -> execute -> postprocess, one step at a time. Generation is interruptible: `pause()`
returns once the loop stands between two steps; the caller may then change the weights in place
and call `resume(version)`; the next step rebuilds the KV cache under the new weights and every
later token carries the new version, while earlier tokens keep theirs. `abort(seq)` stops one sequence
(a client went away, a stop string ended it): it frees its slot, and its callback fires once, with
finish_reason "abort".

Every request is checked before it is admitted (`check`: token ids in [0, vocab_size), a prompt that fits
the context, sampling parameters in their documented ranges), so a bad request is refused on its own instead
of failing a model step that other requests share. Should a step still fail, each running row is run alone
to find the rows it fails on: only those end (finish_reason "error"); the others keep the token their own
run sampled and go on. When every row fails alone, `UNHEALTHY_AFTER` steps in a row, the fault is the engine's,
not a request's (a kernel this CPU cannot run, a broken device): the engine turns unhealthy (`failure` names the
exception), ends what it holds with "error" and refuses new requests with `EngineUnhealthy`, so the service can
report NOT_SERVING and answer 503 instead of "error" for every request forever.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel

from services.common.cpu_features import describe
from services.common.device import check_device, resolve_device
from services.common.errors import FieldError
from services.common.hf_models import image_slots, load_lm
from services.common.logging import get_logger
from services.common.torch_threads import fix_torch_threads
from services.rollout.engines.base import EngineStats, EngineUnhealthy, check_images, check_request, check_token_ids
from services.rollout.engines.lora_merge import AdapterConfig, AdapterMerge
from services.rollout.engines.runner import ModelRunner, Scored
from services.rollout.engines.scheduler import Scheduler, Step
from services.rollout.engines.sequence import Images, Sampling, Sequence, Status

DTYPES = ("float32", "bfloat16")
UNHEALTHY_AFTER = 3  # consecutive steps on which every row failed, even alone


@dataclasses.dataclass(kw_only=True)
class EngineConfig:
    model_path: str = "artifacts/models/tiny-qwen3"
    max_batch: int = 64
    max_context: int = 512
    seed: int = 0
    torch_threads: int = 1       # OpenMP threads of the engine's thread (the one that runs the model); 0: torch's default
    initial_version: int = 0
    device: str = "cpu"          # cpu | cuda | npu, or cuda:N / npu:N: weights, KV cache and sampling live there
    dtype: str = "float32"       # float32 | bfloat16: the weights and KV cache (weight sync casts what arrives to it)
    prepack: bool = True         # CPU: linear layers run on oneDNN-prepacked copies of their weights (faster, 2x memory)
    prefix_cache_mb: int = 512   # KV of prompt prefixes kept across requests (LRU, cleared at weight updates); 0: off
    record_routes: bool = False  # MoE routing replay: each token's routed experts travel with its trajectory
    lora: AdapterConfig = dataclasses.field(default_factory=AdapterConfig)  # r > 0: weight syncs send LoRA adapters

    def __post_init__(self) -> None:
        check_device(self.device)
        if self.dtype not in DTYPES:
            raise FieldError("engine.dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if isinstance(self.prefix_cache_mb, bool) or not isinstance(self.prefix_cache_mb, int) or self.prefix_cache_mb < 0:
            raise FieldError("engine.prefix_cache_mb", f"must be an integer >= 0 (0: off), got {self.prefix_cache_mb!r}")

    def build(self) -> EmbeddedEngine:
        # This thread only loads; the engine's own thread runs the model with torch_threads (see _loop). A second
        # OpenMP team in the process (this thread's) would make libgomp throttle its spin-waits: every parallel
        # op got ~40% slower (a SmolLM2 bf16 decode step 44 -> 62 ms).
        fix_torch_threads(1)
        device = resolve_device(self.device)
        model = load_lm(self.model_path, getattr(torch, self.dtype)).to(device)
        _own_memory(model)
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        engine = EmbeddedEngine(model, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                              max_batch=self.max_batch, max_context=self.max_context, seed=self.seed,
                              version=self.initial_version, prepack=self.prepack,
                              torch_threads=self.torch_threads, prefix_cache_bytes=self.prefix_cache_mb << 20,
                              record_routes=self.record_routes, lora=self.lora)
        get_logger().info("engine_built", dtype=self.dtype, device=str(device), linear_path=engine.runner.linear_path,
                          **(describe() if device.type == "cpu" else {}))
        return engine


class EmbeddedEngine:
    kind = "embedded"

    def __init__(self, model: PreTrainedModel, *, eos_token_id: int, pad_token_id: int, max_batch: int,
                 max_context: int, seed: int, version: int = 0, prepack: bool = True,
                 torch_threads: int = 1, prefix_cache_bytes: int = 0, record_routes: bool = False,
                 lora: AdapterConfig | None = None) -> None:
        self.model = model
        self.version = version
        self.scheduler = Scheduler(max_batch=max_batch, eos_token_id=eos_token_id, max_context=max_context)
        self.vocab_size = _vocab_size(model)
        self.image_slots = image_slots(model)  # (placeholder id, placeholders per image); None: a text model
        self.runner = ModelRunner(model, pad_token_id=pad_token_id, seed=seed, prepack=prepack,
                                  prefix_cache_bytes=prefix_cache_bytes, record_routes=record_routes)
        self.stats = EngineStats()
        # LoRA adapters as the weights: the sync fills their buffers, resume merges them into the weights
        self.adapters = AdapterMerge(model, lora) if lora is not None and lora.enabled else None
        self.torch_threads = torch_threads
        self._cv = threading.Condition()
        self._pause_requests = 0
        self._paused = False
        self._stopped = False
        self.failure: str | None = None  # set once the engine is unhealthy: the exception that every row hit
        self._failed_in_a_row = 0
        self._jobs: collections.deque[tuple[Callable[[], Any], Callable[[Any, BaseException | None], None]]] = \
            collections.deque()  # work for the model between two steps (scoring), run on the engine's thread
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    async def watch(self, stop: asyncio.Event) -> None:
        """Nothing outside this process to watch: the engine's own failures show as `failure`."""

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

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
        """What a weight sync writes: the model's parameters, or with LoRA adapters (engine.lora) those."""
        if self.adapters is not None:
            return dict(self.adapters.tensors)
        return dict(self.model.named_parameters())

    def weight_receiver_args(self) -> dict[str, Any]:
        return {"params": self.named_parameters()}

    # submission ----------------------------------------------------------------------------------------
    @property
    def max_context(self) -> int:
        return self.scheduler.max_context

    def check(self, prompt_ids: list[int], sampling: Sampling, n: int = 1, images: Images | None = None) -> None:
        """ValueError naming the field when a request cannot run here; nothing is admitted before this passed."""
        check_request(prompt_ids, sampling, n, max_context=self.scheduler.max_context, vocab_size=self.vocab_size)
        check_images(prompt_ids, images, self.image_slots)

    def submit(self, prompt_ids: list[int], sampling: Sampling, on_finish, *, priority: bool = False,
               images: Images | None = None) -> Sequence:
        """Admit one sequence (after `check`: ValueError naming the field when it cannot run)."""
        self.check(prompt_ids, sampling, images=images)
        seq = Sequence(prompt_ids=list(prompt_ids), sampling=sampling, on_finish=on_finish, priority=priority,
                       images=images)
        with self._cv:
            if self.failure is not None:
                raise EngineUnhealthy(self.failure)
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

    async def generate(self, prompt_ids: list[int], sampling: Sampling, n: int = 1,
                       images: Images | None = None) -> list[Sequence]:
        """Submit n samples of one prompt and wait for all of them (all checked before any is admitted)."""
        self.check(prompt_ids, sampling, n, images)
        if self.failure is not None:
            raise EngineUnhealthy(self.failure)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        group = _Group(n, lambda: loop.call_soon_threadsafe(_resolve, done, None))  # one wake-up per group
        seqs = [self.submit(prompt_ids, sampling, group.finished, images=images) for _ in range(n)]
        try:
            await done
        except asyncio.CancelledError:  # the caller gave up (a handler past its ceiling): free the slots
            for seq in seqs:
                self.abort(seq)
            raise
        return seqs

    async def score(self, contexts: list[list[int]], temperature: float = 1.0, top: int = 0) -> list[Scored]:
        """Each context's token log-probs under the loaded weights (a frozen teacher scoring a student's samples)
        and, with ``top``, the likeliest tokens at each position, computed on the engine's thread between two
        generation steps, never while paused for a weight update."""
        for i, ctx in enumerate(contexts):
            if len(ctx) > self.max_context:
                raise FieldError(f"prompt[{i}]", f"{len(ctx)} tokens, the engine holds at most {self.max_context}")
            check_token_ids(ctx, self.vocab_size, f"prompt[{i}]")
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def deliver(result, error: BaseException | None) -> None:
            if error is None:
                loop.call_soon_threadsafe(_resolve, done, result)
            else:
                loop.call_soon_threadsafe(_fail, done, error)

        with self._cv:
            if self.failure is not None:
                raise EngineUnhealthy(self.failure)
            if self._stopped:
                raise RuntimeError("engine stopped")
            self._jobs.append((lambda: self.runner.score(contexts, temperature, top), deliver))
            self._cv.notify_all()
        return await done

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
                if self.adapters is not None:
                    self.adapters.merge()
                self.scheduler.invalidate()
                self.runner.weights_changed()  # prepacked copies of the weights are rebuilt before the next step
            self._pause_requests = max(0, self._pause_requests - 1)
            self._cv.notify_all()

    async def pause_async(self, timeout: float = 60.0) -> None:
        await asyncio.to_thread(self.pause, timeout)

    async def resume_async(self, version: int | None = None) -> None:
        self.resume(version)

    # the loop -----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.torch_threads > 0:  # OpenMP's thread count belongs to each thread: a new one starts at the default
            fix_torch_threads(self.torch_threads)
        while True:
            with self._cv:
                while not self._stopped and (self._pause_requests or not (self.scheduler.has_work() or self._jobs)):
                    self._paused = self._pause_requests > 0
                    self._cv.notify_all()
                    self._cv.wait(timeout=1.0)
                self._paused = False
                if self._stopped:
                    for _, deliver in self._jobs:
                        deliver(None, RuntimeError("engine stopped"))
                    return
                job = self._jobs.popleft() if self._jobs else None
                if job is None:
                    started = time.perf_counter()
                    step = self.scheduler.schedule()
                    rows, version = step.rows, self.version
            if job is not None:
                self._run_job(*job)
                continue
            try:
                tokens, logprobs = self.runner.run(step)
            except Exception:  # a failed step must not take the engine down with every caller waiting on it
                get_logger().exception("engine_step_failed", rows=len(rows), prefill=step.prefill)
                self._recover(rows, version)
                continue
            with self._cv:
                active = sum(s.status is Status.RUNNING and s not in self.scheduler.aborting for s in rows)
                done = self.scheduler.postprocess(rows, tokens, logprobs, version)
                self.stats.steps += 1
                self._failed_in_a_row = 0
                self.stats.tokens_generated += active
                self._count(done)
                self.stats.busy_seconds += time.perf_counter() - started
                self._count_prefix_cache()
            for seq in done:
                self._finish(seq)

    def _run_job(self, job: Callable[[], Any], deliver: Callable[[Any, BaseException | None], None]) -> None:
        try:
            result = job()
        except Exception as exc:  # noqa: BLE001 - the caller gets it; the engine goes on
            deliver(None, exc)
        else:
            deliver(result, None)

    def _recover(self, rows: list[Sequence], version: int) -> None:
        """After a failed step: run each running row alone. The rows that fail alone end with "error"; the others
        take the token their own run sampled (the step's token for them) and the next step rebuilds the cache."""
        self.runner.drop_cache()
        good: list[Sequence] = []
        bad: list[Sequence] = []
        errors: list[str] = []
        tokens: list[int] = []
        logprobs: list[float] = []
        for seq in [s for s in rows if s.status is Status.RUNNING]:
            try:
                token, logprob = self.runner.run(Step([seq], prefill=True))
            except Exception as exc:  # noqa: BLE001 - whatever the model raises on this row, only this row ends
                get_logger().warning("engine_row_failed", seq_id=seq.seq_id, prompt_tokens=len(seq.prompt_ids),
                                     error=f"{type(exc).__name__}: {exc}")
                bad.append(seq)
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            good.append(seq)
            tokens.append(token[0])
            logprobs.append(logprob[0])
        self.runner.drop_cache()
        with self._cv:
            failed = self.scheduler.fail_rows(bad)
            active = sum(s.status is Status.RUNNING and s not in self.scheduler.aborting for s in good)
            done = self.scheduler.postprocess(good, tokens, logprobs, version)
            self.stats.steps_failed += 1
            self.stats.sequences_failed += len(failed)
            self.stats.tokens_generated += active
            self._count(failed + done)
            self._failed_in_a_row = self._failed_in_a_row + 1 if bad and not good else 0
            if self._failed_in_a_row >= UNHEALTHY_AFTER and self.failure is None:
                failed += self._turn_unhealthy(errors[0])
        for seq in failed + done:
            self._finish(seq)

    def _turn_unhealthy(self, error: str) -> list[Sequence]:  # under the lock
        """Every row failed alone several steps in a row: end what the engine holds, refuse what comes."""
        self.failure = error
        get_logger().error("engine_unhealthy", error=error, failed_steps=self._failed_in_a_row,
                           reason="every row failed alone on each of these steps: the engine, not a request")
        ended = self.scheduler.fail_all()
        self.stats.sequences_failed += len(ended)
        self._count(ended)
        return ended

    def _count_prefix_cache(self) -> None:  # under the lock
        cache = self.runner.prefix
        if cache is not None:
            self.stats.prefix_cache_lookup_tokens = cache.stats.lookup_tokens
            self.stats.prefix_cache_hit_tokens = cache.stats.hit_tokens
            self.stats.prefix_cache_bytes = cache.bytes

    def _count(self, done: list[Sequence]) -> None:  # under the lock
        self.stats.sequences_finished += len(done)
        self.stats.sequences_aborted += sum(s.finish_reason == "abort" for s in done)

    def _finish(self, seq: Sequence) -> None:
        if seq.on_finish:
            seq.on_finish(seq)


def _own_memory(model: torch.nn.Module) -> None:
    """Copy CPU parameters out of the checkpoint's file mapping: loaded in the file's dtype they are views of a
    private mmap, so every page's first in-place write (the first weight update) takes a copy-on-write fault
    (~0.8 s for 0.5 GB), and pages not yet written would follow the file should it change on disk."""
    with torch.no_grad():
        for p in model.parameters():  # a tied weight is one Parameter: it stays tied
            if p.device.type == "cpu":
                p.data = p.data.clone()


def _resolve(fut: asyncio.Future, result) -> None:
    if not fut.done():
        fut.set_result(result)


def _fail(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)


class _Group:
    """Counts the finished samples of one `generate` call (callbacks come from any thread) and wakes the caller's
    event loop once, when the last one finishes: a cross-thread wake-up per sample costs a socket write each."""

    def __init__(self, n: int, wake) -> None:
        self._left = n
        self._lock = threading.Lock()
        self._wake = wake

    def finished(self, seq: Sequence) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._wake()


def _vocab_size(model) -> int | None:
    """Rows of the input embedding: the ids the model can take (None when the model does not tell)."""
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, NotImplementedError, TypeError):
        pass
    size = getattr(model, "vocab_size", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    return int(size) if size else None
