"""The error a user's mistake raises: it names the field, so every edge (gRPC, HTTP, the launcher) can say where.

``FieldError`` is a ``ValueError``, so code that catches ``ValueError`` keeps working, and its text is the
``"field: problem"`` form every error message here takes. An edge that needs the field itself (the gateway's
OpenAI-style ``param``, a config naming the key from the top) reads ``.field`` rather than parsing the text.
"""

from __future__ import annotations

import re

_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class FieldError(ValueError):
    def __init__(self, field: str, problem: str) -> None:
        super().__init__(field, problem)
        self.field = field
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.field}: {self.problem}" if self.field else self.problem  # no field: the run file's top

    def __reduce__(self):  # pickles (worker processes) as its two parts, not as one message
        return type(self), (self.field, self.problem)

    def within(self, where: str) -> FieldError:
        """The same problem named from ``where`` down: ``algo`` within ``services.trainer`` is
        ``services.trainer.algo``; a nested config that names itself (``engine.dtype`` within
        ``services.rollout.engine``) is not named twice."""
        if not where:
            return self
        last = where.rsplit(".", 1)[-1]
        field = self.field[len(last) + 1:] if self.field.startswith(f"{last}.") else self.field
        return type(self)(f"{where}.{field}" if field else where, self.problem)


def field_error(exc: ValueError) -> FieldError | None:
    """``exc`` as a FieldError: itself, or a plain ValueError whose text starts with a field (raised by code we do
    not own: a plugin, a library); None when it names none."""
    if isinstance(exc, FieldError):
        return exc
    found = _FIELD.match(str(exc))
    return FieldError(found.group(1), str(exc)[found.end():]) if found else None
