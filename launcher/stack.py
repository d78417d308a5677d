"""Start, watch and stop the local stack: one nats-server and the five services as processes."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from launcher.agents import AgentDriver
from launcher.processes import NatsServer, free_port
from launcher.report import EventLog, write_report
from launcher.watch import watch_run
from services.rollout.gateway.config import DEV_ADMIN_KEY

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVICES = ("weight_exchange", "reward", "builder", "trainer", "rollout")
DEFAULT_PORTS = {"rollout": 50051, "reward": 50052, "builder": 50053, "trainer": 50054, "weight_exchange": 50055,
                 "nats": 4222, "gateway": 8000}
STATE_FILE = ROOT / ".stack" / "state.json"


def random_ports() -> dict[str, int]:
    return {name: free_port() for name in (*SERVICES, "nats", "gateway")}


# name -> scripts/bootstrap_model.py flags; the agents' model starts higher so sampled groups carry signal
MODELS = {"tiny-qwen3": [], "tiny-qwen3-chat": ["--chat", "--band", "0.3", "0.45"],
          "tiny-qwen3-tools": ["--tools", "--band", "0.3", "0.5", "--eval-every", "25"]}


def ensure_model(name: str, seed: int) -> pathlib.Path:
    """The SFT-warm-started tiny model for this seed, built locally once and cached."""
    if name not in MODELS:
        raise ValueError(f"model: unknown {name!r} (known: {', '.join(MODELS)})")
    path = ROOT / "artifacts" / "models" / f"{name}-seed{seed}"
    if not (path / "model.safetensors").exists():
        print(f"building {path.relative_to(ROOT)} (tokenizer, model, SFT warm start; one line per held-out "
              "evaluation)...", file=sys.stderr)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "bootstrap_model.py"), "--out", str(path),
                        "--seed", str(seed), "--verbose", *MODELS[name]], check=True, cwd=ROOT)
    return path


class Stack:
    def __init__(self, run_dir: pathlib.Path, ports: dict[str, int]) -> None:
        self.run_dir = run_dir
        self.ports = ports
        self.nats = NatsServer(run_dir / "nats", port=ports["nats"])
        self.procs: dict[str, subprocess.Popen] = {}

    def address(self, service: str) -> str:
        return f"127.0.0.1:{self.ports[service]}"

    def start(self, plan: dict, *, seed: int, model_path: pathlib.Path, algo: str = "", detach: bool = False) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        self.nats.start()
        for service in SERVICES:
            cfg = dict(plan.get("services", {}).get(service) or {})
            cfg.update(nats_url=self.nats.url, grpc_address=self.address(service), run_dir=str(self.run_dir),
                       metrics_port=self.ports[service] + 1000 if detach else 0)
            if service in ("rollout", "trainer"):
                cfg["wx_address"] = self.address("weight_exchange")
            if service in ("builder", "reward", "trainer"):
                cfg["model_path"] = str(model_path)
            if service == "rollout":
                cfg.setdefault("gateway", {})["port"] = self.ports["gateway"]
                cfg.setdefault("engine", {})["model_path"] = str(model_path)
                cfg["engine"]["seed"] = seed
            if service in ("builder", "trainer"):
                cfg["seed"] = seed
            if service == "trainer" and algo and algo != cfg.get("algo"):
                cfg["algo"] = algo
                cfg.pop("algo_overrides", None)  # they were chosen for the profile's preset
            if service == "trainer":
                sampling = plan["services"]["builder"].get("sampling", {})
                cfg.setdefault("max_new_tokens", sampling.get("max_new_tokens", 8))
            if service == "trainer":
                cfg.setdefault("total_steps", plan["services"]["builder"].get("total_steps", 0))
            config_file = self.run_dir / "config" / f"{service}.yaml"
            config_file.parent.mkdir(exist_ok=True)
            config_file.write_text(yaml.safe_dump(cfg))
            log = open(self.run_dir / "logs" / f"{service}.log", "ab")  # noqa: SIM115 - owned by the process
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self.procs[service] = subprocess.Popen(
                [sys.executable, "-m", f"services.{service}", "--config", str(config_file)], cwd=ROOT, env=env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=detach)

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.time() + timeout
        for service in SERVICES:
            while not health_check(self.address(service)):
                proc = self.procs[service]
                if proc.poll() is not None:
                    raise RuntimeError(f"{service} exited with {proc.returncode}; see {self.run_dir}/logs/{service}.log")
                if time.time() > deadline:
                    raise TimeoutError(f"{service} not SERVING after {timeout}s")
                time.sleep(0.2)

    def stop(self, grace: float = 30.0) -> dict[str, int | None]:
        """SIGTERM every service (rollout first, so no new work starts), then the bus."""
        for service in reversed(SERVICES):
            proc = self.procs.get(service)
            if proc and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = {}
        for service, proc in self.procs.items():
            try:
                codes[service] = proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[service] = proc.wait()
        self.nats.stop()
        return codes


def health_check(address: str, service: str = "") -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def load_plan(config: str) -> dict:
    plan = yaml.safe_load((ROOT / config).read_text() if not os.path.isabs(config) else pathlib.Path(config).read_text())
    plan.setdefault("services", {}).setdefault("builder", {})
    return plan


def run(config: str, *, name: str, seed: int = 0, algo: str = "", ports: dict[str, int] | None = None,
        runs_root: pathlib.Path | None = None, progress: bool = True, on_healthy=None) -> dict:
    """The main job: start the stack, train until the builder reports the run's end, report, stop."""
    plan = load_plan(config)
    model_path = ensure_model(plan.get("model", "tiny-qwen3"), seed)
    run_dir = (runs_root or ROOT / "runs") / name
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    stack = Stack(run_dir, ports or random_ports())
    events = EventLog(run_dir / "metrics.jsonl")
    started = time.time()
    summary: dict = {"completed": False}
    agents: AgentDriver | None = None
    try:
        stack.start(plan, seed=seed, model_path=model_path, algo=algo)
        stack.wait_healthy()
        if on_healthy is not None:
            on_healthy(stack)
        if plan.get("agents"):
            agents = AgentDriver(plan["agents"], plan.get("agent_args", []), log_path=run_dir / "logs" / "agents.log",
                                 gateway_url=f"http://127.0.0.1:{stack.ports['gateway']}")
            agents.start()
        total = int(plan["services"]["builder"].get("total_steps", 0))
        completed = asyncio.run(watch_run(stack, events, total_steps=total, timeout=float(plan.get("timeout_seconds", 900)),
                                          progress=progress))
        summary = write_report(stack, events, run_dir, plan=plan, seed=seed, algo=algo or plan["services"].get(
            "trainer", {}).get("algo", "grpo"), wall_seconds=time.time() - started, completed=completed)
    finally:
        if agents is not None:
            agents.stop()
        codes = stack.stop()
        summary["exit_codes"] = codes
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


def up(config: str, *, seed: int = 0, algo: str = "") -> None:
    """The same stack in the background, unbounded, on the default ports."""
    if STATE_FILE.exists():
        raise SystemExit(f"a stack is already up ({STATE_FILE}); run `make down` first")
    plan = load_plan(config)
    plan["services"]["builder"]["total_steps"] = 0
    trainer = plan["services"].setdefault("trainer", {})
    trainer["total_steps"] = 0
    trainer.setdefault("optim", {})["schedule"] = "constant"  # an unbounded run has no end to decay to
    rollout = plan["services"].setdefault("rollout", {})
    rollout["gateway_enabled"] = True
    rollout.setdefault("engine", {})["max_context"] = 2048  # agent prompts with tools are long in characters
    model_path = ensure_model(plan.get("model", "tiny-qwen3"), seed)
    stack = Stack(ROOT / "runs" / "up", DEFAULT_PORTS)
    stack.nats.detach = True
    stack.start(plan, seed=seed, model_path=model_path, algo=algo, detach=True)
    STATE_FILE.parent.mkdir(exist_ok=True)
    STATE_FILE.write_text(json.dumps({"pids": {s: p.pid for s, p in stack.procs.items()},
                                      "nats_pid": stack.nats.proc.pid, "ports": DEFAULT_PORTS}))
    stack.wait_healthy()
    print("meshrl is up: " + ", ".join(f"{s} 127.0.0.1:{DEFAULT_PORTS[s]}" for s in SERVICES)
          + f"; nats://127.0.0.1:{DEFAULT_PORTS['nats']}; logs in runs/up/logs")
    admin_key = os.environ.get("MESHRL_ADMIN_KEY")
    print("agent gateway: http://127.0.0.1:8000/v1 (OpenAI), http://127.0.0.1:8000 (Anthropic); admin key: "
          + ("$MESHRL_ADMIN_KEY" if admin_key else f"{DEV_ADMIN_KEY} (development default; set MESHRL_ADMIN_KEY)"))


def down() -> None:
    if not STATE_FILE.exists():
        print("no stack is up")
        return
    state = json.loads(STATE_FILE.read_text())
    pids = [*state["pids"].values()]
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.time() + 30
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    _signal(state["nats_pid"], signal.SIGTERM)
    STATE_FILE.unlink()
    print("meshrl is down")


def status() -> None:
    for service in SERVICES:
        addr = f"127.0.0.1:{DEFAULT_PORTS[service]}"
        print(f"{service:16s} {addr:18s} {'SERVING' if health_check(addr) else 'DOWN'}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass
