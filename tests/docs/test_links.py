"""Every relative link in the user-facing Markdown resolves inside the repository, and nothing points outside it.

Pages: README.md, docs/*.md, every service's README.md (services/**/README.md) and the examples' READMEs.
A link's file must exist under the repository root; anchors are optional (only the file is checked), and a link
that resolves outside the repository's tree is a failure. No page may mention the shared workspace (`../shared`)
that a clone of the repository does not have.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = sorted({ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("services/**/README.md"),
                *ROOT.glob("examples/**/README.md")})

# [text](target) and [text]: target, outside code spans and fenced blocks
INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")
OUTSIDE = re.compile(r"\.\./shared|/work/shared|(^|[\s(`'\"])shared/DESIGN\.md")


def links(text: str) -> list[str]:
    prose = CODE_SPAN.sub("", FENCE.sub("", text))
    return INLINE.findall(prose) + REFERENCE.findall(prose)


def _rel(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def test_pages_found():
    names = {_rel(p) for p in PAGES}
    for required in ("README.md", "docs/architecture.md", "docs/configuration.md", "docs/algorithms.md",
                     "docs/gateway.md", "docs/operations.md", "docs/benchmarks.md"):
        assert required in names, f"{required} is missing"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve_inside_the_repository(page: pathlib.Path):
    broken = []
    for target in links(page.read_text()):
        if target.startswith(EXTERNAL) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (ROOT / path.lstrip("/")) if path.startswith("/") else (page.parent / path)
        resolved = resolved.resolve()
        if not resolved.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            broken.append(f"{target} (no such file)")
    assert not broken, f"{_rel(page)}: broken links: {', '.join(broken)}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_nothing_points_to_the_shared_workspace(page: pathlib.Path):
    hits = [f"line {n}: {line.strip()}" for n, line in enumerate(page.read_text().splitlines(), 1)
            if OUTSIDE.search(line)]
    assert not hits, f"{_rel(page)} points outside the repository: {hits}"


def test_the_checker_sees_links():
    text = "[a](docs/x.md) [b](../up.md#s) `[c](code.md)` [d](https://e.org)\n```\n[f](fenced.md)\n```\n[r]: ref.md\n"
    assert links(text) == ["docs/x.md", "../up.md#s", "https://e.org", "ref.md"]
