"""``python -m services.trainer.algorithms --list`` prints the presets; ``--show NAME`` one full config."""

from __future__ import annotations

import argparse

from .config import AlgorithmConfig
from .presets import DESCRIPTIONS, PRESETS
from .summary import COLUMNS, NOTES, describe


def format_table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def format_presets() -> str:
    """A table (estimator, aggregation, clipping, KL, off-policy correction), notes, then each preset's settings."""
    rows = [("preset", *COLUMNS)]
    rows += [(name, *describe(AlgorithmConfig.from_preset(name, max_new_tokens=1024))) for name in PRESETS]
    lines = format_table(rows)
    lines += ["", "Notes:"] + [f"{name:<13} {note}" for name, note in NOTES.items()]
    lines += ["", "Settings each preset sets:"]
    for name, settings in PRESETS.items():
        lines.append(f"{name:<13} {DESCRIPTIONS[name]}")
        lines.append(" " * 14 + ", ".join(f"{k}={v}" for k, v in settings.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.trainer.algorithms", description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--list", action="store_true", help="print every preset: what it is and its key settings")
    group.add_argument("--show", metavar="NAME", help="print every setting of one preset")
    args = parser.parse_args(argv)
    if args.list:
        print(format_presets())
        return
    try:
        config = AlgorithmConfig.from_preset(args.show)
    except ValueError as e:
        parser.error(str(e))
    for key, value in config.to_dict().items():
        print(f"{key} = {value}")


if __name__ == "__main__":
    main()
