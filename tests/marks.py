"""Parametrize helpers: `full(...)` is a case that only `make test-full` runs (a heavier variant of one that
`make test` keeps: more layouts, models or paths)."""

from __future__ import annotations

import pytest


def full(*values, **kwargs):
    return pytest.param(*values, marks=pytest.mark.full, **kwargs)
