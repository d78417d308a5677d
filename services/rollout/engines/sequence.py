"""A sequence being generated: its tokens, per-token log-probs and policy versions."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from collections.abc import Callable

from services.common.errors import FieldError

_ids = itertools.count()


# The documented ranges of every sampling parameter, at every edge (gateway, Generate RPC, prompt work). A
# temperature above 0 but below MIN_TEMPERATURE samples as at MIN_TEMPERATURE (numerically safe, still ~greedy).
MAX_TEMPERATURE = 10.0
MIN_TEMPERATURE = 1e-4
MAX_TOP_K = 1 << 20
MAX_NEW_TOKENS = 1 << 20
MAX_STOP_TOKEN_IDS = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """temperature in [0, 10] (0: greedy), top_p in (0, 1], top_k in [0, 2^20] (0: off), max_new_tokens in
    [1, 2^20] (an engine also caps it at its context), at most 64 stop token ids, each >= 0. All finite.
    `ignore_eos` generates past the model's end-of-sequence token (fixed-length benchmarks, probes); the stop
    token ids still stop."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _real(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise FieldError("temperature", f"must be a finite number in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise FieldError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not _integer(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            raise FieldError("top_k", f"must be an integer in [0, {MAX_TOP_K}], got {self.top_k}")
        if not _integer(self.max_new_tokens) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise FieldError("max_new_tokens", f"must be an integer in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise FieldError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS}, got {len(self.stop_token_ids)}")
        if not all(_integer(t) and t >= 0 for t in self.stop_token_ids):
            raise FieldError("stop_token_ids", "must be token ids >= 0")
        if not isinstance(self.ignore_eos, bool):
            raise FieldError("ignore_eos", f"must be true or false, got {self.ignore_eos!r}")


def _real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True, eq=False)
class Images:
    """A prompt's images for a vision-language model: their digests (what makes two prompts with the same tokens
    different) and their pixels [images, channels, height, width], in the order of the prompt's placeholders."""
    key: tuple[str, ...]
    pixel_values: object  # torch.Tensor (not imported here: the scheduler is pure)


@dataclasses.dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    sampling: Sampling
    on_finish: Callable[[Sequence], None] | None = None
    priority: bool = False  # interactive (agent gateway) requests go ahead of queued rollout work
    seq_id: int = dataclasses.field(default_factory=lambda: next(_ids))
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str = ""
    first_token_at: float = 0.0  # time.perf_counter() when its first token was appended (0: none yet)
    # MoE routing replay (an engine recording routes): chunks of [positions, layers, top_k] expert indices, in
    # order, for the tokens of `context` the engine fed through the model (all but the last one sampled)
    routes: list | None = None
    images: Images | None = None  # fed with the prompt at every prefill (the first, and after a weight update)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def context_key(self) -> tuple:
        """What identifies the context's KV: its tokens, and its images' digests when it has images."""
        tokens = tuple(self.context)
        return tokens if self.images is None else (tokens, self.images.key)

    @property
    def num_versions(self) -> int:
        return len(set(self.versions))
