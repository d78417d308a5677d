"""Start, watch and stop the local stack: nats-server (one or a three-node cluster) and the five services as
processes, each restarted by a supervisor when it dies (`make run` in-process, `make up` in a detached
`python -m launcher supervise` process that `make down` stops first)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from launcher import preflight
from launcher.agents import AgentDriver, temperature_env
from launcher.cpu import tree_cpu_seconds
from launcher.frozen import FrozenModel, FrozenModels
from launcher.processes import NatsCluster, NatsServer, TrainerRanks, free_port, popen
from launcher.report import EventLog, write_report
from launcher.runconfig import BUILT_IN_MODELS, RunConfig, RunPlan
from launcher.shutdown import SHUTDOWN, Interrupted
from launcher.supervisor import Backoff, Supervisor, pid_alive
from launcher.watch import watch_run
from services.common.auth import OPERATOR
from services.common.config import build_config
from services.common.credentials import LEASED, RunCredentials
from services.common.errors import FieldError
from services.common.net import free_ports
from services.rollout.gateway.config import ADMIN_KEY_FILE

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVICES = ("weight_exchange", "reward", "builder", "trainer", "rollout")
NATS_MODES = ("single", "cluster")
# nats: the (first) client port; nats_1, nats_2 and nats_route_0..2: the other client ports and the route
# ports of a three-node cluster (NATS=cluster)
NATS_CLUSTER_KEYS = ("nats_1", "nats_2", "nats_route_0", "nats_route_1", "nats_route_2")
DEFAULT_PORTS = {"rollout": 50051, "reward": 50052, "builder": 50053, "trainer": 50054, "weight_exchange": 50055,
                 "nats": 4222, "gateway": 8000, "nats_1": 4223, "nats_2": 4224, "nats_route_0": 6222,
                 "nats_route_1": 6223, "nats_route_2": 6224}
STATE_FILE = ROOT / ".stack" / "state.json"


def random_ports() -> dict[str, int]:
    """A free port for every service, NATS and the gateway, all distinct."""
    names = (*SERVICES, "nats", "gateway", *NATS_CLUSTER_KEYS)
    return dict(zip(names, free_ports(len(names)), strict=True))


def ports_held(ports: dict[str, int], names: list[str]) -> list[str]:
    """`name 127.0.0.1:port` for each of `names` whose port another process holds. A plain bind tells: gRPC servers
    bind with SO_REUSEPORT, so a second stack on the same ports would start without an error and share them with
    the first (each getting half of the other's calls), while its nats-server fails to bind and restarts forever.
    SO_REUSEADDR as the servers set it: a port whose last connections are in TIME_WAIT (a run that just ended) is
    free to them, and only a listening socket refuses the bind."""
    held = []
    for name in names:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", ports[name]))
            except OSError:
                held.append(f"{name} 127.0.0.1:{ports[name]}")
    return held


def check_ports_free(ports: dict[str, int], plan: RunPlan, nats_mode: str) -> None:
    """SystemExit naming every port of the stack another process holds, before anything starts."""
    names = [*SERVICES, "nats", *(NATS_CLUSTER_KEYS if nats_mode == "cluster" else ())]
    if plan.configs["rollout"].gateway_enabled:
        names.append("gateway")
    held = ports_held(ports, names)
    if held:
        raise SystemExit(f"ports in use: {', '.join(held)}. Another stack holds them (`meshrl status`; stop it "
                         "with `make down`), or another program does: run with --random-ports (`meshrl run`) "
                         "to take free ones")


def nats_cluster_ports(ports: dict[str, int]) -> tuple[list[int], list[int]]:
    """The three client ports and the three route ports of a local cluster (free ones where `ports` has none)."""
    client = [ports["nats"], ports.get("nats_1") or free_port(), ports.get("nats_2") or free_port()]
    cluster = [ports.get(f"nats_route_{i}") or free_port() for i in range(3)]
    return client, cluster


# name -> scripts/bootstrap_model.py flags; the agents' model starts higher so sampled groups carry signal
MODELS = {"tiny-qwen3": [], "tiny-qwen3-chat": ["--chat", "--band", "0.3", "0.45"],
          "tiny-qwen3-tools": ["--tools", "--band", "0.3", "0.5", "--eval-every", "25"],
          "tiny-qwen3-code": ["--agent", "code", "--band", "0.3", "0.5", "--eval-every", "10"],  # configs/code-agent.yaml
          "tiny-qwen3-search": ["--agent", "search", "--band", "0.3", "0.5", "--eval-every", "25"],
          "tiny-qwen3-moe": ["--experts", "4"],  # a Qwen3-MoE: 4 experts a layer, top-2 (configs/megatron-moe.yaml)
          # a LLaVA (SigLIP tower + the tiny Qwen3) counting shapes in pictures (configs/vlm.yaml); its SFT jumps
          # from chance to ~1.0 within 60 steps, so it is evaluated every 10 and stopped half way (RL: the other half)
          "tiny-vlm": ["--vision", "--band", "0.45", "0.6", "--eval-every", "10"]}
assert tuple(MODELS) == BUILT_IN_MODELS  # the run config tells built-in models from the user's by these names


def ensure_model(name: str, seed: int) -> pathlib.Path:
    """The SFT-warm-started tiny model for this seed, built locally once and cached."""
    if name not in MODELS:
        raise FieldError("model", f"unknown {name!r} (known: {', '.join(MODELS)})")
    path = ROOT / "artifacts" / "models" / f"{name}-seed{seed}"
    if not (path / "model.safetensors").exists():
        print(f"building {path.relative_to(ROOT)} (tokenizer, model, SFT warm start; one line per held-out "
              "evaluation)...", file=sys.stderr)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "bootstrap_model.py"), "--out", str(path),
                        "--seed", str(seed), "--verbose", *MODELS[name]], check=True, cwd=ROOT)
    return path


def frozen_models(run_config: RunConfig, seed: int) -> tuple[dict[str, FrozenModel], dict[str, pathlib.Path]]:
    """The run file's frozen models, typed, and their model directories (a built-in name is built as `model` is)."""
    models = {name: build_config(FrozenModel, spec, f"frozen_models.{name}")
              for name, spec in run_config.frozen_models.items()}
    paths = {}
    for name, m in models.items():
        try:
            paths[name] = resolve_model(m.model, seed)
        except FieldError as exc:
            raise exc.within(f"frozen_models.{name}") from None
    return models, paths


def resolve_model(model: str, seed: int) -> pathlib.Path:
    """A run config's `model`: a built-in name (built once per seed) or a Hugging Face model directory (absolute,
    or relative to the working directory, else to the repository), checked for its config, weights and tokenizer."""
    if not isinstance(model, str) or not model:
        raise FieldError("model", f"a built-in name ({', '.join(MODELS)}) or a model directory, got {model!r}")
    if model in MODELS:
        return ensure_model(model, seed)
    path = pathlib.Path(model).expanduser()
    if not path.is_absolute():
        path = path if path.exists() else ROOT / path
    path = path.resolve()
    if not path.is_dir():
        raise FieldError("model", f"{model!r} is neither a built-in name ({', '.join(MODELS)}) nor a directory")
    missing = [what for what, names in MODEL_FILES.items() if not any((path / n).exists() for n in names)]
    if missing:
        raise FieldError("model", f"{path} is not a Hugging Face model directory: no {' and no '.join(missing)}")
    return path


# what a model directory must hold, each as one of these files
MODEL_FILES = {"config (config.json)": ("config.json",),
               "safetensors weights (model.safetensors, model.safetensors.index.json)":
                   ("model.safetensors", "model.safetensors.index.json"),
               "tokenizer (tokenizer.json, tokenizer_config.json)": ("tokenizer.json", "tokenizer_config.json")}


class Stack:
    """nats-server (one, or a three-node cluster) and the five services as supervised processes.

    A process that dies is started again (same command line, config file, ports and log file) after a back-off
    (`launcher.supervisor.Backoff`), until `stop()`; `kill()` is the hook for chaos tests.

    Secure by default: the run's credentials are generated once under `<run_dir>/secrets` (services.common.credentials)
    and every process, restarted or not, gets the same: its gRPC token and the peers' digests, its NATS user (the
    nats-server config with every user's permissions is written there too). `secure=False`: no credentials at all.
    The launcher's own clients (watch, report, audit) authenticate as the operator.
    """

    def __init__(self, run_dir: pathlib.Path, ports: dict[str, int], *, nats_mode: str = "single",
                 rng: random.Random | None = None, policy: Backoff | None = None, secure: bool = True) -> None:
        if nats_mode not in NATS_MODES:
            raise FieldError("nats_mode", f"must be one of {', '.join(NATS_MODES)}, got {nats_mode!r}")
        self.run_dir = run_dir
        self.ports = ports
        self.nats_mode = nats_mode
        self.rng = rng or random.Random()
        logs = run_dir / "logs"
        self.credentials = RunCredentials.ensure(run_dir / "secrets") if secure else None
        auth: dict = {}
        if self.credentials is not None:
            auth = {"authorization": self.credentials.nats_authorization()}
        self.nats: NatsServer | NatsCluster
        if nats_mode == "single":
            self.nats = NatsServer(run_dir / "nats", port=ports["nats"], log_path=logs / "nats.log", **auth,
                                   config_path=run_dir / "secrets" / "nats.conf" if auth else None)
        else:
            client, cluster = nats_cluster_ports(ports)
            if self.credentials is not None:
                auth.update(config_dir=run_dir / "secrets", route_auth=self.credentials.route_credentials(),
                            connect_options=self.nats_connect_options)
            self.nats = NatsCluster(run_dir / "nats", client, cluster, log_dir=logs, **auth)
        self.supervisor = Supervisor(policy, log_path=logs / "supervisor.log")
        self.config_files: dict[str, pathlib.Path] = {}
        self.trainer_ranks: TrainerRanks | None = None  # ranks 1.. of a trainer with `ranks` > 1
        self._nats_node = 0  # the cluster node the latest kill("nats") hit
        self.standbys: dict[str, str] = {}  # single-active service -> its second instance's supervised name (chaos)
        self._log_starts: dict[str, int] = {}  # supervised name -> where its current process's log lines begin

    # credentials of the launcher's own clients (the operator)

    @property
    def nats_connect_options(self) -> dict:
        """Keyword arguments for `nats.connect` as the operator ({} without credentials)."""
        return self.credentials.nats_connect_options(OPERATOR) if self.credentials is not None else {}

    @property
    def bus_options(self) -> dict:
        """Keyword arguments for `services.common.bus.Bus.connect` as the operator."""
        return self.credentials.bus_options(OPERATOR) if self.credentials is not None else {}

    @property
    def operator_token(self) -> str:
        """The operator's gRPC bearer token ("" without credentials)."""
        return self.credentials.token(OPERATOR) if self.credentials is not None else ""

    # what runs

    @property
    def nats_children(self) -> list[str]:
        """The supervised names of the NATS processes: "nats", or "nats-n0".."nats-n2" in cluster mode."""
        if isinstance(self.nats, NatsCluster):
            return [f"nats-n{i}" for i in range(len(self.nats.nodes))]
        return ["nats"]

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        """Each started service's current process (the dead one while it waits for its restart)."""
        return {s: self.supervisor.proc(s) for s in SERVICES if s in self.supervisor.names}

    def cpu_seconds(self) -> dict[str, float] | None:
        """CPU-seconds each service's current process (with its children: trainer ranks, verifier workers,
        sandboxes) and the nats-server(s) have spent so far; None off Linux."""
        pids = {name: proc.pid for name, proc in self.procs.items() if proc is not None and proc.poll() is None}
        pids.update((f"trainer-rank{k}", proc.pid) for k, proc in enumerate(
            self.trainer_ranks.followers if self.trainer_ranks is not None else [], start=1) if proc.poll() is None)
        nodes = self.nats.nodes if isinstance(self.nats, NatsCluster) else [self.nats]
        pids.update((f"nats{k or ''}", node.proc.pid) for k, node in enumerate(nodes)
                    if node.proc is not None and node.proc.poll() is None)
        return tree_cpu_seconds(pids)

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts per service and for "nats" (all nodes together in cluster mode)."""
        counts = self.supervisor.restarts
        out = {s: counts.get(s, 0) for s in SERVICES}
        out["nats"] = sum(counts.get(c, 0) for c in self.nats_children)
        return out

    def pid(self, name: str) -> int | None:
        """The pid of a service, of "nats" or of a cluster node ("nats-n1"); None while it is down.

        In cluster mode "nats" means the node the latest `kill("nats")` hit (node 0 before any).
        """
        return self.supervisor.pid(self._child(name))

    def kill(self, name: str, sig: int = signal.SIGKILL, *, rng: random.Random | None = None, hold: float = 0.0) -> str:
        """Send `sig` to one of the five services or "nats"; the supervisor restarts it after its back-off.

        In cluster mode "nats" picks one running node at random (`rng`, else the Stack's `rng`). Returns the
        supervised name signalled ("rollout", "nats", "nats-n2"); wait for `restarts[name]` to grow. `hold`: keep
        it down at least that long (an outage).
        """
        if name == "nats" and isinstance(self.nats, NatsCluster):
            running = [i for i, node in enumerate(self.nats.nodes) if node.alive] or list(range(len(self.nats.nodes)))
            self._nats_node = (rng or self.rng).choice(running)
        child = self._child(name)
        self.supervisor.kill(child, sig, hold=hold)
        return child

    def kill_trainer_rank(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to rank `rank` (>= 1) of the trainer's rank group alone; the group's failure reaches rank 0,
        which the supervisor restarts with the whole group."""
        ranks = self.trainer_ranks
        if ranks is None or not 1 <= rank < ranks.ranks or len(ranks.followers) < rank:
            raise FieldError("rank", f"no trainer rank {rank} running (the trainer has "
                             f"{ranks.ranks if ranks else 1} ranks)")
        with contextlib.suppress(ProcessLookupError):
            ranks.followers[rank - 1].send_signal(sig)

    def _child(self, name: str) -> str:
        if name == "nats":
            return self.nats_children[self._nats_node] if isinstance(self.nats, NatsCluster) else "nats"
        if name in SERVICES or name in self.nats_children or name in self.standbys.values():
            return name
        known = (*SERVICES, *self.standbys.values(), *self.nats_children)
        raise FieldError("name", f"unknown {name!r} (one of {', '.join(known)}, nats)")

    # a second instance of a single-active service (chaos): one of the two serves, the other waits for the lease

    def start_standby(self, service: str) -> str:
        """Start a second, supervised instance of `service` (builder or weight_exchange) beside the first, with the
        same config file and so the same gRPC port: an instance binds it only once it holds the service's lease
        (services.common.lease), so the one address always reaches the active instance and the peers, the health
        checks and the report need no change. Its log is logs/<service>-standby.log. Returns its supervised name."""
        if service not in LEASED:
            raise FieldError("standby", f"{service!r} is not a single-active service (one of {', '.join(LEASED)})")
        if service in self.standbys:
            raise FieldError("standby", f"{service} has a second instance already")
        name = f"{service}-standby"
        self.supervisor.add(name, self._spawner(service, self.config_files[service], detach=False, name=name))
        self.standbys[service] = name
        return name

    def instances(self, service: str) -> list[str]:
        """The supervised names running `service`: itself, and its standby's when one was started."""
        return [service, *([self.standbys[service]] if service in self.standbys else [])]

    def lease_state(self, name: str) -> str:
        """What the current process of instance `name` said of its lease: "active" (it serves), "standby" (it
        waits for the lease), "starting" (neither yet) or "down" (no process runs)."""
        if self.supervisor.pid(name) is None:
            return "down"
        events = lease_events(self._log_path(name), self._log_starts.get(name, 0))
        if "serving" in events:
            return "active"
        return "standby" if "lease_standby" in events else "starting"

    def active(self, service: str) -> str | None:
        """The instance of `service` that serves now (its only one without a standby), or None."""
        if service not in self.standbys:
            return service
        return next((n for n in self.instances(service) if self.lease_state(n) == "active"), None)

    def restart_count(self, name: str) -> int:
        """Restarts of a supervised name ("nats": all of its nodes together)."""
        return self.restarts["nats"] if name == "nats" else self.supervisor.restarts.get(name, 0)

    def _log_path(self, name: str) -> pathlib.Path:
        return self.run_dir / "logs" / f"{name}.log"

    def snapshot(self) -> dict:
        """Pids and restart counts, as `make up` records them in its state file."""
        return {"pids": {s: self.supervisor.pid(s) for s in SERVICES if s in self.supervisor.names},
                "nats_pids": {c: self.supervisor.pid(c) for c in self.nats_children if c in self.supervisor.names},
                "restarts": self.restarts, "nats_url": self.nats.url, "nats_mode": self.nats_mode}

    def address(self, service: str) -> str:
        return f"127.0.0.1:{self.ports[service]}"

    # start and stop

    def start_nats(self, *, detach: bool = False) -> None:
        """Start NATS (waiting until it serves; for a cluster, until JetStream has a meta leader), supervised."""
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.nats.detach = detach
        self.nats.start()
        nodes = self.nats.nodes if isinstance(self.nats, NatsCluster) else [self.nats]
        for child, node in zip(self.nats_children, nodes, strict=True):
            self.supervisor.add(child, node.spawn, proc=node.proc)
        self.supervisor.start()

    def derive(self, run: RunConfig, *, seed: int, model_path: pathlib.Path, algo: str = "",
               detach: bool = False) -> RunPlan:
        """The five service configs for this stack: `RunConfig.derive` with the stack's wiring and its own
        defaults (metrics ports under `make up`, replicas on a cluster)."""
        return run.derive(seed=seed, algo=algo, wiring={s: self.service_wiring(s, model_path) for s in SERVICES},
                          launcher={s: self.launcher_defaults(s, detach=detach) for s in SERVICES})

    def start(self, configs: dict[str, dict], *, detach: bool = False) -> None:
        """Write each service's config file (`RunPlan.values`: every setting), check them as the services will
        load them, start NATS and the services."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for service in SERVICES:
            config_file = self.run_dir / "config" / f"{service}.yaml"
            config_file.parent.mkdir(exist_ok=True)
            config_file.write_text(yaml.safe_dump(configs[service]))
            self.config_files[service] = config_file
        preflight.check_all(self.config_files)  # a config error stops here, before any process starts
        self.start_nats(detach=detach)
        for service in SERVICES:
            self.supervisor.add(service, self._spawner(service, self.config_files[service], detach=detach))

    def launcher_defaults(self, service: str, *, detach: bool = False) -> dict:
        """The stack's own defaults for a service (a section that sets one keeps its value)."""
        defaults: dict = {"metrics_port": self.ports[service] + 1000 if detach else 0}
        if self.nats_mode == "cluster":
            defaults["nats_replicas"] = 3
        return defaults

    def service_wiring(self, service: str, model_path: pathlib.Path) -> dict:
        """What the launcher sets in a service's config and the file may not: the stack's NATS, addresses and
        folder, the run's credentials, the model directory (nested for rollout's gateway and engine)."""
        wiring: dict = {"nats_url": self.nats.url, "grpc_address": self.address(service), "run_dir": str(self.run_dir)}
        if self.credentials is not None:
            wiring.update(self.credentials.service_config(service))
        if service in ("rollout", "trainer"):
            wiring["wx_address"] = self.address("weight_exchange")
        if service in ("builder", "reward", "trainer"):
            wiring["model_path"] = str(model_path)
        if service == "rollout":
            wiring["reward_address"] = self.address("reward")
            wiring["gateway"] = {"port": self.ports["gateway"]}
            wiring["engine"] = {"model_path": str(model_path)}
        return wiring

    def _spawner(self, service: str, config_file: pathlib.Path, *, detach: bool, name: str = ""):
        """Starts the service; every restart gets the same config file, ports and (appended) log file. `name`: the
        supervised name and log of a second instance (`start_standby`)."""
        name = name or service
        log_path = self._log_path(name)
        ranks = int((yaml.safe_load(config_file.read_text()) or {}).get("ranks", 1)) if service == "trainer" else 1
        if ranks > 1:  # a trainer group: ranks 1.. start and stop with rank 0
            self.trainer_ranks = TrainerRanks([sys.executable, "-m", "services.trainer", "--config", str(config_file)],
                                              ranks, log_path.parent, cwd=ROOT,
                                              env={**os.environ, "PYTHONUNBUFFERED": "1"}, detach=detach)
            return self.trainer_ranks.spawn

        def spawn() -> subprocess.Popen:
            with open(log_path, "ab") as log:
                self._log_starts[name] = log.tell()  # this process's lines come after what earlier ones wrote
                return popen([sys.executable, "-m", f"services.{service}", "--config", str(config_file)], cwd=ROOT,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT,
                             detach=detach)

        return spawn

    def wait_healthy(self, timeout: float = 120.0, *, max_exits: int = 3) -> None:
        """Until every service is SERVING; raises when one exits `max_exits` times meanwhile (a crash loop)."""
        deadline = time.time() + timeout
        before = self.supervisor.restarts
        for service in SERVICES:
            while not health_check(self.address(service)):
                proc = self.supervisor.proc(service)
                down = proc is not None and proc.poll() is not None
                exits = self.supervisor.restarts[service] - before[service] + int(down)
                if exits >= max_exits:
                    raise RuntimeError(f"{service} exited {exits} times while starting (last exit code "
                                       f"{proc.returncode}); see {self.run_dir}/logs/{service}.log")
                if time.time() > deadline:
                    raise TimeoutError(f"{service} not SERVING after {timeout}s")
                time.sleep(0.2)

    def stop(self, grace: float = 30.0, *, nats_grace: float = 5.0) -> dict[str, int | None]:
        """Stop supervising, then SIGTERM every service (rollout first, so no new work starts), then the bus.

        The services share one `grace` (all stop at once, so the whole stop takes at most about grace +
        nats_grace + a few seconds): whatever still runs then is SIGKILLed with its process group (its own
        children); trainer ranks 1.. get what is left of it."""
        self.supervisor.stop()
        procs = self.procs
        procs.update({n: self.supervisor.proc(n) for n in self.standbys.values()})
        for name in [*self.standbys.values(), *reversed(SERVICES)]:
            proc = procs.get(name)
            if proc and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        codes = {}
        for service, proc in procs.items():
            try:
                codes[service] = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                codes[service] = proc.wait(timeout=10)
        if self.trainer_ranks is not None:
            self.trainer_ranks.stop(max(0.1, deadline - time.monotonic()))
        self.nats.stop(nats_grace)
        return codes


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a child and its process group (popen gives each child its own: the group is its pid)."""
    for kill in (os.killpg, os.kill):
        try:
            kill(proc.pid, signal.SIGKILL)
        except OSError:
            pass


LEASE_EVENTS = ("lease_standby", "lease_abandoned", "lease_acquired", "serving", "lease_renew_retry")


def lease_events(log_path: pathlib.Path, start: int = 0) -> list[str]:
    """The lease events (and "serving") a single-active service logged from byte `start` of its log, in order."""
    try:
        with open(log_path, "rb") as f:
            f.seek(start)
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            event = json.loads(line).get("event")
        except (ValueError, AttributeError):
            continue
        if event in LEASE_EVENTS:
            out.append(event)
    return out


def health_check(address: str, service: str = "") -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def run(config: str, *, name: str, seed: int = 0, algo: str = "", ports: dict[str, int] | None = None,
        runs_root: pathlib.Path | None = None, progress: bool = True, on_healthy=None,
        nats_mode: str = "single", before_stop=None, on_started=None) -> dict:
    """The main job: start the stack, train until the builder reports the run's end, report, stop.

    A service (or NATS) that dies meanwhile is restarted; the run ends on the builder's RUN_END or its timeout.
    Hooks: `on_started(stack)` once every process is started; `on_healthy(stack, events)` once every service
    serves; `before_stop(stack, summary)` after the report, while the stack still runs.

    SIGINT / SIGTERM (with `launcher.shutdown.SHUTDOWN` handling them, as the CLI does): the stack stops within
    its budget, summary.json says "interrupted", and `Interrupted` is raised on after saying where the run is.
    """
    run_config = RunConfig.load(config, root=ROOT)
    # a mistake in the file, or a port another process holds, stops here: before the old run's folder goes
    checked = run_config.derive(seed=seed, algo=algo)
    model_path = resolve_model(run_config.model, seed)
    run_dir = (runs_root or ROOT / "runs") / name
    ports = ports or random_ports()
    check_ports_free(ports, checked, nats_mode)
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    stack = Stack(run_dir, ports, nats_mode=nats_mode)
    frozen = FrozenModels(*frozen_models(run_config, seed), run_dir) if run_config.frozen_models else None
    if frozen is not None:
        frozen.serve_reference(run_config.services.trainer)
    plan = stack.derive(run_config, seed=seed, model_path=model_path, algo=algo)
    print(plan.describe(), file=sys.stderr, flush=True)
    events = EventLog(run_dir / "metrics.jsonl")
    started = time.time()
    summary: dict = {"completed": False}
    agents: AgentDriver | None = None
    SHUTDOWN.results = str(run_dir)
    try:
        if frozen is not None:  # first: a served teacher answers the trainer from its start
            frozen.start(run_config.startup_timeout_seconds)
        stack.start(plan.files())
        if on_started is not None:
            on_started(stack)
        stack.wait_healthy(run_config.startup_timeout_seconds)  # a real model loads slowly
        if on_healthy is not None:
            on_healthy(stack, events)
        if run_config.agents:
            agents = AgentDriver(run_config.agents, run_config.agent_args, log_path=run_dir / "logs" / "agents.log",
                                 gateway_url=f"http://127.0.0.1:{stack.ports['gateway']}",
                                 env={**(frozen.env() if frozen is not None else {}),
                                      **temperature_env(plan.configs["builder"].sampling.temperature)})
            agents.start()
        completed = asyncio.run(watch_run(stack, events, total_steps=plan.total_steps,
                                          timeout=run_config.timeout_seconds, progress=progress))
        summary = write_report(stack, events, run_dir, eta=plan.eta, agents=bool(run_config.agents), seed=seed,
                               algo=plan.trainer.algo, wall_seconds=time.time() - started, completed=completed)
        if before_stop is not None:
            before_stop(stack, summary)
    finally:
        with SHUTDOWN.stopping():
            _stop_run(stack, agents, summary, run_dir, nats_mode, frozen)
    print(json.dumps(summary, indent=2))
    return summary


def _stop_run(stack: Stack, agents: AgentDriver | None, summary: dict, run_dir: pathlib.Path, nats_mode: str,
              frozen: FrozenModels | None = None) -> None:
    """The end of `run`, also after a signal (then within the shutdown budget): agents, frozen models, stack,
    summary.json."""
    if agents is not None:
        agents.stop(timeout=3.0 if SHUTDOWN.interrupted else 10.0)
    if frozen is not None:
        summary["frozen_exit_codes"] = frozen.stop(timeout=3.0 if SHUTDOWN.interrupted else 10.0)
    codes = stack.stop(SHUTDOWN.grace(30.0))
    summary["exit_codes"] = codes
    summary["restarts"] = stack.restarts
    summary["nats_mode"] = nats_mode
    if SHUTDOWN.interrupted:
        summary["interrupted"] = Interrupted(SHUTDOWN.received).name
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if SHUTDOWN.interrupted:
        print(f"meshrl: stopped by {summary['interrupted']}; every process of the run is stopped; the run's results "
              f"so far (summary.json, metrics.jsonl, logs/, checkpoints/) are in {run_dir}", file=sys.stderr,
              flush=True)


# make up / down / status: `up` writes the stack's spec into STATE_FILE and starts a detached supervisor
# process (`python -m launcher supervise --state STATE_FILE`) that owns the processes: it starts them,
# restarts any that dies, records pids and restarts in STATE_FILE, and on SIGTERM (`make down`) stops
# supervising, stops everything and removes STATE_FILE.

UP_CONFIG = "configs/run.yaml"  # `make up` without CONFIG: the main job's settings, made unbounded


def up(config: str | None = None, *, seed: int = 0, algo: str = "", nats_mode: str = "single",
       timeout: float = 180.0) -> None:
    """The same stack in the background, on the default ports, kept running by a supervisor process: unbounded,
    with the agent gateway, unless the run file `config` says otherwise (`launcher.runfile.UP_DEFAULTS`; without
    one, UP_CONFIG with those settings over its own)."""
    if nats_mode not in NATS_MODES:
        raise SystemExit(f"--nats: must be one of {', '.join(NATS_MODES)}, got {nats_mode!r}")
    if STATE_FILE.exists():
        raise SystemExit(f"a stack is already up ({STATE_FILE}); run `make down` first")
    run_config = RunConfig.load(config or UP_CONFIG, root=ROOT).unbounded(force=config is None)
    # a mistake in the file, or a port another process holds, stops here
    check_ports_free(DEFAULT_PORTS, run_config.derive(seed=seed, algo=algo), nats_mode)
    model_path = resolve_model(run_config.model, seed)
    run_dir = ROOT / "runs" / "up"
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    plan = Stack(run_dir, DEFAULT_PORTS, nats_mode=nats_mode).derive(run_config, seed=seed, model_path=model_path,
                                                                      algo=algo, detach=True)
    print(plan.describe(), file=sys.stderr, flush=True)
    spec = {"configs": plan.files(), "nats_mode": nats_mode,
            "ports": DEFAULT_PORTS, "run_dir": str(run_dir)}
    write_state(STATE_FILE, {"status": "starting", "spec": spec})
    launcher_log = run_dir / "logs" / "launcher.log"
    with open(launcher_log, "ab") as log:
        supervisor = subprocess.Popen([sys.executable, "-m", "launcher", "supervise", "--state", str(STATE_FILE)],
                                      cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + timeout
    for service in SERVICES:
        while not health_check(f"127.0.0.1:{DEFAULT_PORTS[service]}"):
            if supervisor.poll() is not None:
                STATE_FILE.unlink(missing_ok=True)
                raise SystemExit(f"the supervisor exited with {supervisor.returncode}; see {launcher_log}")
            restarts = read_state(STATE_FILE).get("restarts", {}).get(service, 0)
            if restarts >= 3:
                raise SystemExit(f"{service} keeps exiting ({restarts} restarts); see {run_dir}/logs/{service}.log, "
                                 "then `make down`")
            if time.time() > deadline:
                raise SystemExit(f"{service} not SERVING after {timeout}s; see {run_dir}/logs, then `make down`")
            time.sleep(0.2)
    nats_url = read_state(STATE_FILE).get("nats_url", f"nats://127.0.0.1:{DEFAULT_PORTS['nats']}")
    print("meshrl is up: " + ", ".join(f"{s} 127.0.0.1:{DEFAULT_PORTS[s]}" for s in SERVICES)
          + f"; {nats_url}; logs in runs/up/logs; supervised (pid {supervisor.pid}, runs/up/logs/supervisor.log)")
    secrets_dir = (run_dir / "secrets").relative_to(ROOT)
    print(f"credentials (mode 0600) in {secrets_dir}: gRPC as operator: grpcurl -plaintext -H \"authorization: Bearer "
          f"$(cat {secrets_dir}/grpc-operator.token)\" 127.0.0.1:{DEFAULT_PORTS['trainer']} "
          f"meshrl.v1.TrainerService/Status; NATS as operator: user operator, password in "
          f"{secrets_dir}/nats-operator.password")
    admin_key = os.environ.get("MESHRL_ADMIN_KEY")
    print("agent gateway: http://127.0.0.1:8000/v1 (OpenAI), http://127.0.0.1:8000 (Anthropic); admin key: "
          + ("$MESHRL_ADMIN_KEY" if admin_key else f"generated at start into runs/up/{ADMIN_KEY_FILE} (mode 0600)"))


def supervise(state_path: pathlib.Path) -> int:
    """The detached supervisor of `make up`: start the stack from the spec in `state_path`, keep it running
    (recording pids and restarts there), and on SIGTERM or SIGINT stop supervising, stop it all (within
    `launcher.shutdown.STOP_BUDGET_S`), remove the file. Returns the exit code: 128 + the signal's number."""
    state = read_state(state_path)
    spec = state["spec"]
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    stack = Stack(pathlib.Path(spec["run_dir"]), spec["ports"], nats_mode=spec.get("nats_mode", "single"))
    SHUTDOWN.results = spec["run_dir"]

    def save(status: str) -> None:
        write_state(state_path, {**state, "status": status, "supervisor_pid": os.getpid(), **stack.snapshot()})

    try:
        with SHUTDOWN.handling():
            try:
                save("starting")
                stack.start(spec["configs"], detach=True)
                save("running")
                last = None
                while True:  # until a signal (Interrupted)
                    time.sleep(1.0)
                    snapshot = stack.snapshot()
                    if snapshot != last:
                        save("running")
                        last = snapshot
            finally:
                with SHUTDOWN.stopping():
                    save("stopping")
                    codes = stack.stop(SHUTDOWN.grace(30.0))
                    print(json.dumps({"stopped": True, "exit_codes": codes, "restarts": stack.restarts,
                                      "results": spec["run_dir"]}), file=sys.stderr, flush=True)
                    state_path.unlink(missing_ok=True)
    except Interrupted as exc:
        return exc.exit_code
    return 1  # not reached: only a signal ends supervision


def down(grace: float = 30.0) -> None:
    """Stop the supervisor first (it stops the services and NATS), then anything it left behind."""
    if not STATE_FILE.exists():
        print("no stack is up")
        return
    state = read_state(STATE_FILE)
    deadline = time.time() + 10
    while "supervisor_pid" not in state and time.time() < deadline and STATE_FILE.exists():  # still starting
        time.sleep(0.2)
        state = read_state(STATE_FILE) or state
    pid = state.get("supervisor_pid")
    if pid and pid_alive(pid):
        _signal(pid, signal.SIGTERM)
        deadline = time.time() + grace + 30  # it gives the services `grace` s, then stops NATS
        while time.time() < deadline and pid_alive(pid):
            time.sleep(0.2)
        _signal(pid, signal.SIGKILL)
        state = read_state(STATE_FILE) or state
    # a supervisor that crashed or was killed leaves its processes running
    pids = [p for p in state.get("pids", {}).values() if p and pid_alive(p)]
    for p in pids:
        _signal(p, signal.SIGTERM)
    deadline = time.time() + grace
    while time.time() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.2)
    for p in pids:
        _signal(p, signal.SIGKILL)
    for p in state.get("nats_pids", {}).values():
        if p:
            _signal(p, signal.SIGTERM)
    STATE_FILE.unlink(missing_ok=True)
    print("meshrl is down")


def status() -> None:
    state = read_state(STATE_FILE)
    restarts = state.get("restarts", {})
    for service in SERVICES:
        addr = f"127.0.0.1:{DEFAULT_PORTS[service]}"
        line = f"{service:16s} {addr:18s} {'SERVING' if health_check(addr) else 'DOWN'}"
        print(line + (f"  restarts {restarts[service]}" if restarts.get(service) else ""))
    if state:
        for child, pid in state.get("nats_pids", {}).items():
            alive = bool(pid) and pid_alive(pid)
            print(f"{child:16s} {'pid ' + str(pid) if pid else '':18s} {'RUNNING' if alive else 'DOWN'}")
        if restarts.get("nats"):
            print(f"nats restarts: {restarts['nats']}")
        sup = state.get("supervisor_pid")
        print(f"supervisor       pid {sup or '-'} {'RUNNING' if sup and pid_alive(sup) else 'DOWN'} "
              f"({state.get('status', '?')}, nats {state.get('nats_mode', '?')})")


def read_state(path: pathlib.Path) -> dict:
    """The state file's content, {} when there is none (or it is being replaced)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def write_state(path: pathlib.Path, state: dict) -> None:
    """Atomically: readers see the old or the new file, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass
