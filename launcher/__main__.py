"""`python -m launcher run|up|down|status`: the local stack (nats-server + five service processes)."""

from __future__ import annotations

import argparse
import sys

from launcher.stack import DEFAULT_PORTS, down, run, status, up


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launcher")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "up"):
        p = sub.add_parser(name)
        p.add_argument("--config", default="configs/run.yaml")
        p.add_argument("--name", default="")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--algo", default="")
    sub.add_parser("down")
    sub.add_parser("status")
    args = parser.parse_args(argv)
    if args.command == "run":
        summary = run(args.config, name=args.name or f"seed{args.seed}", seed=args.seed, algo=args.algo,
                      ports=DEFAULT_PORTS)
        sys.exit(0 if summary.get("completed") else 1)
    if args.command == "up":
        up(args.config, seed=args.seed, algo=args.algo)
    elif args.command == "down":
        down()
    else:
        status()


if __name__ == "__main__":
    main()
