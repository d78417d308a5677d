"""`meshrl`: the local stack (nats-server + five service processes), a deployed run's report, the benchmarks, the
algorithm presets and model conversion, as one command. `python -m launcher` is the same command."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys

from launcher import reporter
from launcher.shutdown import SHUTDOWN, Interrupted
from launcher.stack import (
    DEFAULT_PORTS,
    MODELS,
    NATS_MODES,
    ROOT,
    STATE_FILE,
    UP_CONFIG,
    down,
    ensure_model,
    random_ports,
    run,
    status,
    supervise,
    up,
)

BENCH_DIR = ROOT / "bench"
SCRIPTS_DIR = ROOT / "scripts"


def bench_names(folder: pathlib.Path = BENCH_DIR) -> list[str]:
    """The modules under bench/ that define a top-level main (read, not imported: some import torch)."""
    main = re.compile(r"^(async )?def main\(", re.MULTILINE)
    return [p.stem for p in sorted(folder.glob("*.py")) if main.search(p.read_text())]


def converter_names(folder: pathlib.Path = SCRIPTS_DIR) -> list[str]:
    return [p.stem.removeprefix("convert_") for p in sorted(folder.glob("convert_*.py"))]


def _run(args: argparse.Namespace) -> int:
    with SHUTDOWN.handling():
        summary = run(args.config, name=args.name or f"seed{args.seed}", seed=args.seed, algo=args.algo,
                      ports=random_ports() if args.random_ports else DEFAULT_PORTS, nats_mode=args.nats,
                      runs_root=args.runs_root)
    return 0 if summary.get("completed") else 1


def _chaos(args: argparse.Namespace) -> int:
    from launcher.chaos import TARGETS, chaos

    services = tuple(s.strip() for s in args.services.split(",") if s.strip()) or TARGETS
    standby = tuple(s.strip() for s in args.standby.split(",") if s.strip())
    with SHUTDOWN.handling():
        report = chaos(args.config, seed=args.seed, kills=args.kills, services=services, name=args.name,
                       nats_mode=args.nats, nats_outage=args.nats_outage, model_seed=args.model_seed,
                       standby=standby, fill=args.fill, churn=args.churn)
    print(json.dumps({k: v for k, v in report.items() if k != "schedule"}, indent=2))
    return 0 if report["passed"] else 1


def _bench(args: argparse.Namespace) -> int:
    return subprocess.call([sys.executable, "-m", f"bench.{args.name}", *args.args], cwd=ROOT)


def _algorithms(args: argparse.Namespace) -> int:
    from services.trainer.algorithms.__main__ import main as algorithms_main

    algorithms_main(["--show", args.show] if args.show else ["--list"])
    return 0


def _model(args: argparse.Namespace) -> int:
    if args.name in MODELS:
        seed = argparse.ArgumentParser(prog=f"meshrl model {args.name}")
        seed.add_argument("--seed", type=int, default=0)
        print(ensure_model(args.name, seed.parse_args(args.args).seed))
        return 0
    script = SCRIPTS_DIR / f"convert_{args.name}.py"
    if not script.exists():
        known = ", ".join(converter_names()) or "none"
        raise SystemExit(f"meshrl model: no converter for {args.name!r} ({script.relative_to(ROOT)} does not "
                         f"exist; known: {known})")
    return subprocess.call([sys.executable, str(script), *args.args], cwd=ROOT)


def _stack_arguments(p: argparse.ArgumentParser, *, config: str | None = "configs/run.yaml") -> None:
    p.add_argument("--config", default=config, help="run config, relative to the repository or absolute "
                   f"(default: {config or UP_CONFIG + ' made unbounded, with the agent gateway'})")
    p.add_argument("--name", default="", help="the run's folder under runs/ (default: seed<SEED>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--algo", default="", help="trainer algorithm preset (default: the config's; see `meshrl algorithms`)")
    p.add_argument("--nats", choices=NATS_MODES, default="single",
                   help="one nats-server, or a three-node JetStream cluster with R3 streams")


def build_parser(prog: str = "meshrl") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="meshrl: asynchronous RL post-training as five services "
                                     "over NATS JetStream and gRPC.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="train: start the stack, follow the run to its end, write runs/<name>/, stop")
    _stack_arguments(p)
    p.add_argument("--random-ports", action="store_true", help="free ports instead of the default ones (50051.., "
                   "4222, 8000), so it runs beside a stack that is up")
    p.add_argument("--runs-root", type=pathlib.Path, default=None, help="the folder of run folders (default: runs/)")
    p.set_defaults(handler=_run)
    p = sub.add_parser("up", help="the same stack in the background on the default ports, supervised")
    _stack_arguments(p, config=None)
    p.set_defaults(handler=lambda a: up(a.config, seed=a.seed, algo=a.algo, nats_mode=a.nats))
    sub.add_parser("down", help="stop the stack that `up` started").set_defaults(handler=lambda a: down())
    sub.add_parser("status", help="the stack's processes and services").set_defaults(handler=lambda a: status())

    p = sub.add_parser("chaos", help="a shortened run with services and nats-server killed and restarted")
    p.add_argument("--config", default="configs/chaos.yaml")
    p.add_argument("--name", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kills", type=int, default=None, help="number of kills (default: one per service)")
    p.add_argument("--services", default="", help="comma-separated targets (default: the five services and nats; "
                   "trainer-rank1: the second rank of a trainer rank group alone)")
    p.add_argument("--nats", choices=NATS_MODES, default="single")
    p.add_argument("--nats-outage", type=float, default=0.0, help="seconds nats-server stays down when killed")
    p.add_argument("--model-seed", type=int, default=0, help="the run's model and sampling seed (--seed picks kills)")
    p.add_argument("--standby", default="", help="comma-separated single-active services (builder, weight_exchange) "
                   "that run a second instance as a standby; a kill hits the active one")
    p.add_argument("--fill", type=float, default=0.0, help="fill TRAJ to this fraction of its byte cap first")
    p.add_argument("--churn", type=float, default=0.0, help="with --fill: filler bytes a second during the run")
    p.set_defaults(handler=_chaos)

    p = sub.add_parser("report", help="follow a deployed run's EVENTS until its end; write summary, metrics, plot")
    reporter.add_arguments(p)
    p.set_defaults(handler=reporter.main)

    p = sub.add_parser("bench", help="run a benchmark under bench/; arguments after NAME go to it")
    p.add_argument("name", choices=bench_names(), metavar="NAME", help=f"one of: {', '.join(bench_names())}")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments (NAME --help lists them)")
    p.set_defaults(handler=_bench)

    p = sub.add_parser("algorithms", help="the algorithm presets: estimator, aggregation, clipping, KL, correction")
    p.add_argument("--show", metavar="PRESET", help="every setting of one preset")
    p.set_defaults(handler=_algorithms)

    p = sub.add_parser("model", help="build a built-in model, or convert one, into a Hugging Face directory the stack "
                       "loads")
    p.add_argument("name", metavar="NAME", help=f"a built-in model ({', '.join(MODELS)}; --seed N) or "
                   f"scripts/convert_NAME.py ({', '.join(converter_names())})")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the converter's own arguments (NAME --help lists them)")
    p.set_defaults(handler=_model)

    p = sub.add_parser("supervise", help="(started by `up`) keep the stack in --state running until SIGTERM")
    p.add_argument("--state", type=pathlib.Path, default=STATE_FILE)
    p.set_defaults(handler=lambda a: supervise(a.state))
    return parser


def main(argv: list[str] | None = None, *, prog: str = "meshrl") -> None:
    """A user's mistake (a config setting, a path, a model name: ValueError) is one line on stderr and exit code
    2; MESHRL_TRACEBACK=1 shows the traceback instead. SIGINT / SIGTERM on run, chaos and supervise: exit code
    128 + the signal's number once everything they started has stopped (`launcher.shutdown`)."""
    args = build_parser(prog).parse_args(argv)
    try:
        code = args.handler(args) or 0
    except Interrupted as exc:  # SIGINT / SIGTERM: the command stopped what it started and said where the run is
        code = exc.exit_code
    except ValueError as exc:
        if os.environ.get("MESHRL_TRACEBACK"):
            raise
        print(f"{prog}: error: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)
