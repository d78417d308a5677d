"""What the rollout service needs of an inference engine (the embedded torch engine and the vLLM engine both).

An engine generates token-in / token-out: every output token comes with its log-prob (under softmax(logits / T)
of the weights that sampled it, before top-k / top-p truncation) and the policy version of those weights.
Generation is interruptible: `pause_async()` returns once no token is being produced; the caller may change the
weights; `resume_async(version)` continues, every later token carrying `version` (the KV cache of the earlier
tokens is recomputed under the new weights), while earlier tokens keep theirs.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from services.common.errors import FieldError
from services.rollout.engines.sequence import Images, Sampling, Sequence

MAX_SAMPLES = 1024  # samples of one prompt per call (Generate.n, PromptWork.group_size)


@dataclasses.dataclass
class EngineStats:
    """What every engine counts. A step is one model step (embedded) or one reply or streamed chunk read (server
    engines); busy_seconds is time in model steps (embedded) or with at least one request in flight (servers)."""
    tokens_generated: int = 0
    sequences_finished: int = 0
    weight_updates: int = 0
    interrupted_sequences: int = 0
    sequences_aborted: int = 0
    sequences_failed: int = 0   # ended with "error": a model step (or the server) failed on them
    steps_failed: int = 0
    steps: int = 0
    busy_seconds: float = 0.0
    prefix_cache_lookup_tokens: int = 0  # prompt tokens of the contexts prefilled (engines with a prefix cache)
    prefix_cache_hit_tokens: int = 0     # ... whose KV came from the prefix cache instead of the model
    prefix_cache_bytes: int = 0


class EngineUnhealthy(RuntimeError):
    """The engine cannot generate at all (every step failed, whatever the request): the message names the cause."""


@runtime_checkable
class Engine(Protocol):
    kind: str               # "embedded", "vllm", "vllm_ascend", "sglang" (the Status RPC's `engine`)
    version: int            # the policy version of the weights loaded now (tags every token generated from now on)
    stats: EngineStats      # counters the Status RPC and the pause clock read
    vocab_size: int | None
    failure: str | None     # None while healthy; else why the engine cannot generate (requests get EngineUnhealthy)

    @property
    def paused(self) -> bool: ...

    @property
    def max_context(self) -> int: ...       # prompt + output tokens of one sequence, at most

    # lifecycle
    def start(self) -> None: ...            # may block for minutes (a server engine starts its server): run it off
                                            # the event loop
    def stop(self) -> None: ...             # every unfinished sequence ends with finish_reason "abort"

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop`: raises when what the engine runs on dies (a server engine's process), so the service goes
        down with it; returns at once when there is nothing outside the process to watch (the embedded engine)."""

    # load, for the Status RPC
    def num_running(self) -> int: ...       # sequences being generated now
    def num_waiting(self) -> int: ...       # admitted, not being generated (queued, or cut by a pause)

    # requests
    def check(self, prompt_ids: list[int], sampling: Sampling, n: int = 1) -> None:
        """ValueError naming the field when the request cannot run on this engine (nothing admitted)."""

    def submit(self, prompt_ids: list[int], sampling: Sampling, on_finish: Callable[[Sequence], None] | None, *,
               priority: bool = False) -> Sequence:
        """Admit one sequence; `on_finish(seq)` fires once when it ends (any thread). `seq.output_ids`,
        `seq.logprobs` and `seq.versions` grow as tokens arrive."""

    def abort(self, seq: Sequence) -> None:
        """Stop generating `seq`; its callback fires once, with finish_reason "abort" (unless it had finished)."""

    async def generate(self, prompt_ids: list[int], sampling: Sampling, n: int = 1) -> list[Sequence]: ...

    # interruption (weight updates)
    async def pause_async(self, timeout: float = 60.0) -> None: ...
    async def resume_async(self, version: int | None = None) -> None: ...

    # where a weight update writes to
    def named_parameters(self) -> Mapping[str, Any]:
        """Tensors under their Hugging Face names that the weight exchange's receiver writes into in place; the
        new weights take effect at `resume_async(version)`."""

    def weight_receiver_args(self) -> dict[str, Any]:
        """Keyword arguments for the weight exchange's ReceiverAgent: `params` (the tensors above), or, where the
        engine's own workers pull their shards, `shards`, `parallel`, `framework` and `pull`."""




def check_request(prompt_ids: list[int], sampling: Sampling, n: int, *, max_context: int,
                  vocab_size: int | None) -> None:
    """What every engine checks before admitting a request; ValueError naming the field."""
    if not isinstance(sampling, Sampling):
        raise FieldError("sampling", f"expected Sampling, got {type(sampling).__name__}")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
        raise FieldError("n", f"must be an integer in [1, {MAX_SAMPLES}], got {n!r}")
    if not prompt_ids:
        raise FieldError("prompt_ids", "empty")
    if len(prompt_ids) >= max_context:
        raise FieldError("prompt_ids", f"{len(prompt_ids)} tokens, the engine holds at most {max_context - 1}")
    check_token_ids(prompt_ids, vocab_size, "prompt_ids")
    check_token_ids(sampling.stop_token_ids, vocab_size, "stop_token_ids", allow_empty=True)
    if sampling.max_new_tokens > max_context:
        raise FieldError("max_new_tokens", f"must be <= the engine's context {max_context}, got {sampling.max_new_tokens}")


def check_images(prompt_ids: list[int], images: Images | None, slots: tuple[int, int] | None) -> None:
    """ValueError naming the field unless the prompt's image placeholders match its images: `slots` is the
    model's (placeholder token id, placeholders per image), None for a model that takes no images."""
    if slots is None:
        if images is not None:
            raise FieldError("images", "this engine's model takes no images (it is not a vision-language model)")
        return
    token, per_image = slots
    placeholders = sum(1 for t in prompt_ids if t == token)
    count = 0 if images is None else len(images.key)
    if placeholders != count * per_image:
        raise FieldError("images", f"{count} image(s) take {count * per_image} placeholder tokens (id {token}), the "
                         f"prompt has {placeholders}")
    if images is not None and tuple(images.pixel_values.shape[:1]) != (count,):
        raise FieldError("images", f"pixel_values holds {images.pixel_values.shape[0]} images, the key names {count}")


def check_token_ids(ids, vocab_size: int | None, field: str, *, allow_empty: bool = False) -> None:
    """ValueError naming `field` unless every id is an integer in [0, vocab_size)."""
    if not ids:
        if allow_empty:
            return
        raise FieldError(field, "empty")
    if not all(type(t) is int for t in ids):
        raise FieldError(field, "token ids must be integers")
    low, high = min(ids), max(ids)
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        bad = low if low < 0 else high
        raise FieldError(field, f"token id {bad} is outside the vocabulary {bound}")
