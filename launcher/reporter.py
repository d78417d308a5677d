"""`python -m launcher report`: follow a deployed run (Compose, Kubernetes) on its EVENTS stream until the builder's
RUN_END, then write metrics.jsonl, summary.json and reward_accuracy.png into --out, as `make run` does.

The services are reached by address (their Compose or Kubernetes names). Every replica behind a name that resolves
to several addresses (`docker compose --scale`, a headless Service) is asked for its work counters, which land in
summary.json under "replicas". Restarting the reporter replays the stream from the start and rewrites the files.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import socket
import time
from types import SimpleNamespace

import grpc

from launcher.report import EventLog, write_report
from launcher.watch import watch_run
from services.common.auth import OPERATOR
from services.common.contracts import common_pb2, reward_pb2_grpc, rollout_pb2_grpc
from services.common.credentials import RunCredentials

DEFAULT_ADDRESSES = {"rollout": "rollout:50051", "reward": "reward:50052", "builder": "builder:50053",
                     "trainer": "trainer:50054"}
# per replica: the counter that proves it did work
WORK = {"rollout": (rollout_pb2_grpc.RolloutServiceStub, "trajectories_published"),
        "reward": (reward_pb2_grpc.RewardServiceStub, "scored")}


@dataclasses.dataclass
class Remote:
    """What launcher.watch and launcher.report ask of a stack, for services reached by address."""

    nats_url: str
    addresses: dict[str, str]
    operator_token: str = ""
    nats_connect_options: dict = dataclasses.field(default_factory=dict)

    @property
    def nats(self) -> SimpleNamespace:
        return SimpleNamespace(url=self.nats_url)

    def address(self, service: str) -> str:
        return replica_addresses(self.addresses[service])[0]


def replica_addresses(address: str) -> list[str]:
    """Every IPv4 address HOST resolves to, as IP:PORT (one per replica behind a Compose service name)."""
    host, _, port = address.rpartition(":")
    try:
        infos = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return [address]
    return sorted({f"{info[4][0]}:{port}" for info in infos}) or [address]


def replica_work(service: str, address: str, token: str = "") -> list[dict]:
    """[{"address", <work counter>}] for each replica of `service` (an unreachable one: "error")."""
    stub_cls, counter = WORK[service]
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    out = []
    for addr in replica_addresses(address):
        with grpc.insecure_channel(addr) as channel:
            try:
                reply = stub_cls(channel).Status(common_pb2.StatusRequest(), timeout=5, metadata=metadata)
                out.append({"address": addr, counter: int(getattr(reply, counter))})
            except grpc.RpcError as exc:
                out.append({"address": addr, "error": exc.code().name})
    return out


def report(nats_url: str, out: pathlib.Path, *, total_steps: int, eta: int = 1, algo: str = "grpo", seed: int = 0,
           timeout: float = 86400.0, addresses: dict[str, str] | None = None, token: str = "",
           nats_options: dict | None = None, progress: bool = True) -> dict:
    """Follow the run to its end (or `timeout`), write the report into `out`, return the summary.

    `token` is the operator's gRPC bearer token, `nats_options` its `nats.connect` credentials."""
    addresses = {**DEFAULT_ADDRESSES, **(addresses or {})}
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)  # replayed from the stream's start
    events = EventLog(out / "metrics.jsonl")
    remote = Remote(nats_url, addresses, token, nats_options or {})
    started = time.time()
    completed = asyncio.run(watch_run(remote, events, total_steps=total_steps, timeout=timeout, progress=progress))
    times = [r["at"] for r in events.records if r.get("at")]
    wall = max(times) - min(times) if len(times) > 1 else time.time() - started
    summary = write_report(remote, events, out, eta=eta, agents=False, seed=seed, algo=algo, wall_seconds=wall,
                           completed=completed)
    summary["replicas"] = {service: replica_work(service, addresses[service], token) for service in WORK}
    summary["trajectories_generated"] = sum(r.get("trajectories_published", 0) for r in summary["replicas"]["rollout"])
    tmp = out / ".summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out / "summary.json")
    return summary


def add_arguments(parser) -> None:
    parser.add_argument("--nats", required=True, help="NATS URL (a cluster: comma-separated)")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="where summary.json, metrics.jsonl and the "
                        "plot go")
    parser.add_argument("--total-steps", type=int, required=True)
    parser.add_argument("--eta", type=int, default=1, help="the builder's max_staleness (for the summary)")
    parser.add_argument("--algo", default="grpo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=86400.0, help="seconds to wait for the run's end")
    for service, address in DEFAULT_ADDRESSES.items():
        parser.add_argument(f"--{service}", default=address, help=f"{service}'s gRPC address (default {address})")
    parser.add_argument("--token", default=os.environ.get("MESHRL_AUTH_TOKEN", ""),
                        help="gRPC bearer token (default: $MESHRL_AUTH_TOKEN)")
    parser.add_argument("--secrets", type=pathlib.Path, default=os.environ.get("MESHRL_SECRETS") or None,
                        help="a run's credentials directory (python -m services.common.credentials): the operator's "
                        "gRPC token and NATS user come from it (default: $MESHRL_SECRETS)")


def main(args) -> int:
    token, nats_options = args.token, {}
    if args.secrets:
        creds = RunCredentials(args.secrets)
        token, nats_options = creds.token(OPERATOR), creds.nats_connect_options(OPERATOR)
    summary = report(args.nats, args.out, total_steps=args.total_steps, eta=args.eta, algo=args.algo, seed=args.seed,
                     timeout=args.timeout, token=token, nats_options=nats_options,
                     addresses={s: getattr(args, s) for s in DEFAULT_ADDRESSES})
    print(json.dumps({k: summary.get(k) for k in ("completed", "steps", "eval_accuracy_before", "eval_accuracy_after",
                                                  "trajectories_generated", "trajectories_trained", "replicas")}))
    return 0 if summary.get("completed") else 1
