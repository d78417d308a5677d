"""A sequence being generated: its tokens, per-token log-probs and policy versions."""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Callable

_ids = itertools.count()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_versions(self) -> int:
        return len(set(self.versions))
