"""`python -m launcher run|up|down|status|supervise|chaos|report`: the local stack (nats-server + five service
processes); `report` follows a deployed run (Compose, Kubernetes) and writes its results."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from launcher import reporter
from launcher.stack import DEFAULT_PORTS, NATS_MODES, STATE_FILE, down, run, status, supervise, up


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launcher")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "up"):
        p = sub.add_parser(name)
        p.add_argument("--config", default="configs/run.yaml")
        p.add_argument("--name", default="")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--algo", default="")
        p.add_argument("--nats", choices=NATS_MODES, default="single",
                       help="one nats-server, or a three-node JetStream cluster with R3 streams")
    sub.add_parser("down")
    sub.add_parser("status")
    p = sub.add_parser("chaos", help="a shortened run with services and nats-server killed and restarted")
    p.add_argument("--config", default="configs/chaos.yaml")
    p.add_argument("--name", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kills", type=int, default=None, help="number of kills (default: one per service)")
    p.add_argument("--services", default="", help="comma-separated targets (default: the five services and nats)")
    p.add_argument("--nats", choices=NATS_MODES, default="single")
    p.add_argument("--nats-outage", type=float, default=0.0, help="seconds nats-server stays down when killed")
    p.add_argument("--model-seed", type=int, default=0, help="the run's model and sampling seed (--seed picks kills)")
    p = sub.add_parser("supervise", help="(started by `up`) keep the stack in --state running until SIGTERM")
    p.add_argument("--state", type=pathlib.Path, default=STATE_FILE)
    p = sub.add_parser("report", help="follow a deployed run's EVENTS until its end; write summary, metrics, plot")
    reporter.add_arguments(p)
    args = parser.parse_args(argv)
    if args.command == "report":
        sys.exit(reporter.main(args))
    if args.command == "run":
        summary = run(args.config, name=args.name or f"seed{args.seed}", seed=args.seed, algo=args.algo,
                      ports=DEFAULT_PORTS, nats_mode=args.nats)
        sys.exit(0 if summary.get("completed") else 1)
    if args.command == "chaos":
        from launcher.chaos import TARGETS, chaos

        services = tuple(s.strip() for s in args.services.split(",") if s.strip()) or TARGETS
        report = chaos(args.config, seed=args.seed, kills=args.kills, services=services, name=args.name,
                       nats_mode=args.nats, nats_outage=args.nats_outage, model_seed=args.model_seed)
        print(json.dumps({k: v for k, v in report.items() if k != "schedule"}, indent=2))
        sys.exit(0 if report["passed"] else 1)
    if args.command == "up":
        up(args.config, seed=args.seed, algo=args.algo, nats_mode=args.nats)
    elif args.command == "supervise":
        supervise(args.state)
    elif args.command == "down":
        down()
    else:
        status()


if __name__ == "__main__":
    main()
