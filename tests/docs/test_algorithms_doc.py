"""docs/algorithms.md lists every preset, with the columns `--list` prints for it."""

from __future__ import annotations

import pathlib

from services.trainer.algorithms.config import AlgorithmConfig
from services.trainer.algorithms.presets import PRESETS
from services.trainer.algorithms.summary import describe

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


def _rows() -> dict[str, list[str]]:
    rows = {}
    for line in PAGE.read_text().splitlines():
        if line.startswith("| `"):
            cells = [c.strip().replace("\\|", "|") for c in line.strip().strip("|").split(" | ")]
            rows[cells[0].strip("`")] = cells
    return rows


def test_every_preset_has_a_current_row():
    rows = _rows()
    assert set(rows) == set(PRESETS), f"presets missing or extra in docs/algorithms.md: {set(PRESETS) ^ set(rows)}"
    for name in PRESETS:
        expected = list(describe(AlgorithmConfig.from_preset(name, max_new_tokens=1024)))
        assert rows[name][2:] == expected, f"docs/algorithms.md row {name!r} is stale: --list says {expected}"
