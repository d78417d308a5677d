"""`python -m services.reward.sandbox run FILE [--stdin FILE] [--timeout S]`: one JSON line with the result."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from services.reward.sandbox.config import SandboxConfig
from services.reward.sandbox.pool import SandboxUnavailable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.reward.sandbox")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a program in the sandbox")
    run.add_argument("file", type=pathlib.Path)
    run.add_argument("--stdin", type=pathlib.Path, help="a file fed to the program's stdin")
    run.add_argument("--timeout", type=float, help="wall-clock seconds (default: the configured limit)")
    run.add_argument("--language", default="python")
    args = parser.parse_args(argv)
    try:
        sandbox = SandboxConfig(concurrency=1).build()
        code = args.file.read_text(encoding="utf-8")
        stdin = args.stdin.read_bytes() if args.stdin else b""
        result = sandbox.run(code, stdin, args.language, args.timeout)
    except (SandboxUnavailable, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
