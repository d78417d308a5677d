"""The docs name files that exist: every repository path in backticks in the README, CONTRIBUTING, docs/ and the
services' READMEs, and every module of docs/architecture.md's code layout."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("services/**/README.md")]
PATH = re.compile(r"`((?:services|launcher|bench|scripts|configs|deploy|proto|tests|docs|examples)/[\w./-]+?)"
                  r"(?::[0-9-]+)?`")


def test_every_path_the_docs_name_exists():
    missing = [f"{doc.relative_to(ROOT)}: {m[1]}" for doc in DOCS for m in PATH.finditer(doc.read_text())
               if not (ROOT / m[1].rstrip(".")).exists()]
    assert not missing, "\n".join(missing)


def test_the_architecture_pages_code_layout_names_real_modules():
    block = (ROOT / "docs" / "architecture.md").read_text().split("## Code layout")[1].split("```")[1]
    missing = []
    for line in block.strip().splitlines():
        folder, _, rest = line.partition(" ")
        if not folder.startswith("services/"):
            continue
        for word in re.split(r",\s*|\s+\+\s+", re.sub(r"\([^)]*\)", "", rest).strip()):
            name = word.strip().rstrip("/")
            if name and not ((ROOT / folder / f"{name}.py").exists() or (ROOT / folder / name).is_dir()):
                missing.append(f"{folder}{name}")
    assert not missing, missing
