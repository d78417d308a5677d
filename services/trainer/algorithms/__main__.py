"""``python -m services.trainer.algorithms --list`` prints the presets; ``--show NAME`` one full config."""

from __future__ import annotations

import argparse

from .config import AlgorithmConfig
from .presets import DESCRIPTIONS, PRESETS


def format_presets() -> str:
    lines = []
    for name, settings in PRESETS.items():
        lines.append(f"{name:<13} {DESCRIPTIONS[name]}")
        lines.append(" " * 14 + ", ".join(f"{k}={v}" for k, v in settings.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.trainer.algorithms", description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--list", action="store_true", help="print every preset with its key settings")
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
