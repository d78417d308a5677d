"""How a source file runs inside the sandbox, per language (Python only, for now)."""

from __future__ import annotations

import dataclasses

from services.common.errors import FieldError


@dataclasses.dataclass(frozen=True)
class Language:
    name: str
    filename: str  # the program's name inside the sandbox (read-only, in SOURCE_DIR)
    memory_markers: tuple[str, ...]  # a last stderr line starting with one of these means "out of memory"

    def command(self, interpreter: str, path: str) -> list[str]:
        if self.name == "python":
            return [interpreter, "-I", "-B", path]  # -I: no PYTHON* variables, user site or script-dir imports
        raise AssertionError(f"no command for {self.name}")


LANGUAGES = {"python": Language("python", "main.py", ("MemoryError",))}


def language(name: str) -> Language:
    if name not in LANGUAGES:
        raise FieldError("language", f"unknown {name!r} (known: {', '.join(LANGUAGES)})")
    return LANGUAGES[name]
