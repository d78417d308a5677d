"""The unit every dataset source yields."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Task:
    """One prompt and how to grade it.

    A task has a ``prompt`` string or, for chat datasets, ``messages`` (a list of ``{"role", "content"}``
    dicts ending with the user's turn). ``metadata`` is what the reward service reads besides the answer
    (``verifier``, ``extract``, ``verifier_options``, ``shaping``, ``row``, ``rg_entry``; see
    ``services.builder.tasks.make_work``).
    """

    task_id: str
    prompt: str
    answer: str
    messages: list[dict[str, Any]] | None = dataclasses.field(default=None, hash=False)
    metadata: dict[str, Any] = dataclasses.field(default_factory=lambda: {"verifier": "math"}, hash=False)
    # a preference row: the preferred and the dispreferred reply to the prompt (the builder publishes them as one
    # pre-scored pair for DPO; nothing is generated for it)
    chosen: str | None = None
    rejected: str | None = None
    # encoded images (PNG, JPEG...) in the order of the prompt's image placeholders, for a vision-language model
    images: tuple[bytes, ...] = dataclasses.field(default=(), hash=False, repr=False)

    @property
    def is_pair(self) -> bool:
        return self.chosen is not None

    @property
    def question(self) -> str:
        """The question as text: the prompt, or the last user turn of a chat task (for judges and plugins)."""
        if self.messages:
            users = [m.get("content") for m in self.messages if m.get("role") == "user"]
            if users and isinstance(users[-1], str):
                return users[-1]
        return self.prompt
