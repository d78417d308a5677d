"""The `extended` marker: chaos cases too long for `make test` (most services' kills, a cluster node lost, NATS
outages past a minute and past the dedupe window, TRAJ at its cap). They run with `make chaos-extended` (MESHRL_CHAOS_EXTENDED=1) and are skipped otherwise."""

from __future__ import annotations

import os

import pytest

EXTENDED_ENV = "MESHRL_CHAOS_EXTENDED"


def pytest_configure(config):
    config.addinivalue_line("markers", "extended: a long chaos case, run by `make chaos-extended` only")


def pytest_collection_modifyitems(config, items):
    if os.environ.get(EXTENDED_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"a long chaos case: `make chaos-extended` (or {EXTENDED_ENV}=1) runs it")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)
