"""docs/configuration.md is generated from the config dataclasses; this fails when the committed page is stale."""

from __future__ import annotations

import difflib
import functools
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


@functools.cache
def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_configuration_page_is_current():
    generated = _generator().render()
    committed = (ROOT / "docs" / "configuration.md").read_text()
    if committed != generated:
        diff = "".join(list(difflib.unified_diff(committed.splitlines(True), generated.splitlines(True),
                                                 "docs/configuration.md (committed)", "generated"))[:60])
        raise AssertionError("docs/configuration.md is stale: run `python scripts/gen_config_docs.py`\n" + diff)


def test_every_config_field_is_on_the_page():
    """Each service's own fields and every nested section appear as rows (the generator walks them all)."""
    import dataclasses

    gen = _generator()
    page = (ROOT / "docs" / "configuration.md").read_text()
    for name, _, path in gen.SERVICES:
        cls = gen.load(path)
        assert f"\n## {name}\n" in page, name
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in page, f"{name}.{field.name}"


def test_field_comments_are_read():
    gen = _generator()
    docs = gen.field_docs(gen.load("services.builder.config:BuilderConfig"))
    assert docs["max_staleness"].comment == "eta"
    gateway = gen.field_docs(gen.load("services.rollout.gateway.config:GatewayConfig"))
    assert gateway["export_mode"].heading == "sessions and export"
