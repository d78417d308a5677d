"""deploy/compose and deploy/docker, offline: the compose file's references hold, its settings load into each
service's typed config, and `docker compose config` accepts it where a Compose binary is installed."""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from services.builder.config import BuilderConfig
from services.common.config import load_config
from services.reward.config import RewardConfig
from services.rollout.config import RolloutConfig
from services.trainer.config import TrainerConfig
from services.weight_exchange.config import WeightExchangeConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose" / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
SERVICES = {"weight-exchange": ("weight_exchange", WeightExchangeConfig, 50055), "reward": ("reward", RewardConfig, 50052),
            "builder": ("builder", BuilderConfig, 50053), "trainer": ("trainer", TrainerConfig, 50054),
            "rollout": ("rollout", RolloutConfig, 50051)}


def interpolate(value, env: dict[str, str]):
    """Compose's ${VAR:-default} and $$ (enough for this file), recursively."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value
    value = re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m[1]) or (m[2] or ""), value)
    return value.replace("$$", "$")


@pytest.fixture(scope="module")
def compose() -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), {"MESHRL_TOTAL_STEPS": "20"})


def test_services_healthchecks_restart_policy_and_dependencies(compose):
    services = compose["services"]
    assert {"nats", "model", "reporter", *SERVICES} <= set(services)
    for name, spec in services.items():
        for dep, cond in (spec.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert cond["condition"] in ("service_healthy", "service_completed_successfully", "service_started")
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}'s health, which it does not report"
        for volume in spec.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith((".", "/")) or source in compose["volumes"], f"{name}: volume {source}"
    for name, (module, _, port) in SERVICES.items():
        spec = services[name]
        assert spec["restart"] == "unless-stopped" and spec["command"] == [module]
        assert spec["healthcheck"]["test"] == ["CMD", "python", "-m", "services.common.healthcheck", f":{port}"]
        assert spec["depends_on"]["nats"]["condition"] == "service_healthy"
    nats_cmd = services["nats"]["command"]
    assert nats_cmd[:3] == ["nats-server", "-c", "/secrets/nats.conf"] and "-js" in nats_cmd
    assert "nats:/data" in services["nats"]["volumes"]


def test_every_service_authenticates_with_its_own_generated_credentials(compose):
    services = compose["services"]
    assert "python -m services.common.credentials /secrets" in services["secrets"]["command"][-1]
    for name, (module, _cls, _) in SERVICES.items():
        env = environment(compose, name)
        prefix = f"MESHRL_{module.upper()}__"
        assert env[prefix + "AUTH_TOKEN_FILE"] == f"/secrets/grpc-{module}.token", name
        assert env[prefix + "AUTH_PEERS_FILE"] == "/secrets/grpc-peers.json"
        assert env[prefix + "NATS_USER"] == module and env[prefix + "NATS_PASSWORD_FILE"].endswith(f"{module}.password")
        assert f"secrets-{module}:/secrets:ro" in services[name]["volumes"]
        assert not any(k.endswith("__AUTH_TOKEN") for k in env), f"{name}: a token in the environment"
    reporter = services["reporter"]["command"]
    assert reporter[reporter.index("--secrets") + 1] == "/secrets"


# the secrets job, run for real with its volumes as folders

SECRET_MOUNT = "/secrets"
IDENTITY_OF = {"reporter": "operator", **{name: module for name, (module, _, _) in SERVICES.items()}}


def mounts(spec: dict) -> dict[str, str]:
    """A service's named-volume mounts: container path -> volume name."""
    out = {}
    for volume in spec.get("volumes", []):
        source, target = volume.split(":")[:2]
        if not source.startswith((".", "/", "$")):
            out[target] = source
    return out


def run_secrets_job(compose: dict, root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Run the `secrets` service's command here, each of its volumes a folder under `root` (the chown, which needs
    root, left out after checking it covers every folder it writes); returns volume name -> folder."""
    spec = compose["services"]["secrets"]
    assert spec["command"][:2] == ["sh", "-c"]
    script = spec["command"][2]
    chown = re.search(r"&&\s*chown -R 10001:10001 ([^&]+)$", script)
    assert chown, "the secrets job must hand the files to the services' user (uid 10001)"
    owned = chown[1].split()
    volumes = {}
    for target, volume in mounts(spec).items():
        assert any(target == o or target.startswith(o.rstrip("/") + "/") for o in owned), f"{target} not chowned"
        volumes[target] = root / volume
        volumes[target].mkdir(parents=True)
    run_locally(script[:chown.start()], volumes)
    return {volume: volumes[target] for target, volume in mounts(spec).items()}


def run_locally(script: str, volumes: dict[str, pathlib.Path]) -> None:
    """`script` with each mount point (a whole path component) replaced by its folder, in one pass."""
    targets = sorted(volumes, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w/.-])(" + "|".join(map(re.escape, targets)) + r")(?=[/\s]|$)")
    local = re.sub(r"^python ", f"{sys.executable} ", pattern.sub(lambda m: str(volumes[m[1]]), script))
    subprocess.run(["sh", "-c", local], check=True, capture_output=True, cwd=ROOT, timeout=120)


def secrets_seen(compose: dict, service: str, volumes: dict[str, pathlib.Path]) -> dict[str, bytes]:
    """What `service`'s container finds under /secrets: file name -> content."""
    spec = compose["services"][service]
    seen = {}
    for target, volume in mounts(spec).items():
        if volume in volumes:
            assert target == SECRET_MOUNT, f"{service}: a secrets volume at {target}"
            assert f"{volume}:{target}:ro" in spec["volumes"], f"{service}: {volume} not read-only"
            seen.update({f.name: f.read_bytes() for f in volumes[volume].iterdir()})
    return seen


@pytest.fixture
def secrets_job(compose, tmp_path) -> dict[str, pathlib.Path]:
    return run_secrets_job(compose, tmp_path / "volumes")


def test_each_container_can_read_only_its_own_identitys_credentials(compose, secrets_job):
    """A compromised container holds no other identity's token or NATS password (the operator's least of all):
    each mounts only its own share, and what it is configured to read is there, byte for byte the generated."""
    from services.common.auth import IDENTITIES

    master = secrets_job["secrets"]
    assert [n for n, s in compose["services"].items() if "secrets" in mounts(s).values()] == ["secrets"]
    secret_values = {i: {(master / f"grpc-{i}.token").read_bytes(), (master / f"nats-{i}.password").read_bytes()}
                     for i in IDENTITIES}
    admin_key = (master / "gateway_admin_key").read_bytes()
    for service, identity in IDENTITY_OF.items():
        seen = secrets_seen(compose, service, secrets_job)
        expected = {f"grpc-{identity}.token", f"nats-{identity}.password", "grpc-peers.json"}
        if identity == "rollout":
            expected.add("gateway_admin_key")
        assert set(seen) == expected, service
        for name, content in seen.items():
            assert content == (master / name).read_bytes(), (service, name)
        for other in set(IDENTITIES) - {identity}:
            assert not secret_values[other] & set(seen.values()), f"{service} can read {other}'s credentials"
        assert (admin_key in seen.values()) == (identity == "rollout"), service
        env = compose["services"][service].get("environment") or {}
        for key, path in env.items():
            if str(path).startswith(SECRET_MOUNT + "/"):
                assert pathlib.PurePosixPath(path).name in seen, f"{service}: {key}={path} is not mounted"
    assert set(secrets_seen(compose, "nats", secrets_job)) == {"nats.conf", "nats-auth.conf"}
    for service in set(compose["services"]) - {*IDENTITY_OF, "nats", "secrets"}:
        assert not secrets_seen(compose, service, secrets_job), f"{service} mounts credentials it does not use"


def test_the_secrets_job_keeps_the_credentials_and_modes_across_reruns(compose, secrets_job, tmp_path):
    """`docker compose up` runs the job again on every start: the same secrets (restarted services keep
    authenticating), files 0600 in folders 0700, and a file left in a share that is no longer granted goes."""
    before = {v: {f.name: f.read_bytes() for f in d.iterdir()} for v, d in secrets_job.items()}
    (secrets_job["secrets-reward"] / "grpc-operator.token").write_text("left from an older layout\n")
    spec = compose["services"]["secrets"]
    script = spec["command"][2]
    run_locally(script[:script.index("&& chown")],
                {target: secrets_job[volume] for target, volume in mounts(spec).items()})
    after = {v: {f.name: f.read_bytes() for f in d.iterdir()} for v, d in secrets_job.items()}
    assert after == before
    for volume, folder in secrets_job.items():
        assert folder.stat().st_mode & 0o777 == 0o700, volume
        for f in folder.iterdir():
            if f.name != "nats.conf":       # holds only the include line, no secret
                assert f.stat().st_mode & 0o777 == 0o600, (volume, f.name)


async def test_the_generated_nats_config_enforces_users(compose, secrets_job, tmp_path):
    """What the `secrets` service writes, served by a real nats-server from the nats container's share: each
    identity connects with the password in its own share, publishes only its subjects; no credentials and a wrong
    password are refused."""
    import nats

    from launcher.processes import free_port, nats_server_binary
    from services.common.credentials import RunCredentials

    nats_cmd = compose["services"]["nats"]["command"]
    conf = secrets_job["secrets-nats"] / pathlib.PurePosixPath(nats_cmd[nats_cmd.index("-c") + 1]).name
    port = free_port()
    server = subprocess.Popen([nats_server_binary(), "-c", str(conf), "-a", "127.0.0.1", "-p",
                               str(port), "-js", "-sd", str(tmp_path / "data")], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url = f"nats://127.0.0.1:{port}"
    builder, trainer = RunCredentials(secrets_job["secrets-builder"]), RunCredentials(secrets_job["secrets-trainer"])
    try:
        nc = None
        for _ in range(50):
            try:
                nc = await nats.connect(url, allow_reconnect=False, **builder.nats_connect_options("builder"))
                break
            except (OSError, nats.errors.NoServersError):
                await asyncio.sleep(0.1)
        assert nc is not None
        denied: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            denied.append(exc)

        nc_trainer = await nats.connect(url, allow_reconnect=False, error_cb=on_error,
                                        **trainer.nats_connect_options("trainer"))
        await nc_trainer.publish("prompts.work", b"not the trainer's subject")
        await nc_trainer.flush()
        await asyncio.sleep(0.2)
        assert any("permissions violation" in str(e).lower() for e in denied)
        await nc.publish("prompts.work", b"the builder's")
        await nc.flush()
        await nc.close()
        await nc_trainer.close()
        for options in ({}, {"user": "builder", "password": "wrong"}):
            with pytest.raises((nats.errors.Error, OSError)):
                await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2,
                                   **options)
    finally:
        server.terminate()
        server.wait(10)


def environment(compose: dict, service: str) -> dict[str, str]:
    return {k: str(v) for k, v in compose["services"][service]["environment"].items()}


def test_settings_load_into_each_service_config(compose):
    for name, (module, cls, _) in SERVICES.items():
        env = environment(compose, name)
        assert all(k.startswith(f"MESHRL_{module.upper()}__") or (name, k) == ("rollout", "MESHRL_ADMIN_KEY_FILE")
                   for k in env), name
        config = load_config(cls, module, env=env)
        assert config.nats_url == "nats://nats:4222"
        # a scraper in another container reaches /metrics only off loopback
        assert (config.metrics_address, config.metrics_port) == ("0.0.0.0", 9090), name
    trainer = load_config(TrainerConfig, "trainer", env=environment(compose, "trainer"))
    builder = load_config(BuilderConfig, "builder", env=environment(compose, "builder"))
    assert trainer.total_steps == builder.total_steps == 20 and trainer.weight_transport == "tcp"
    reporter = compose["services"]["reporter"]["command"]
    assert reporter[:4] == ["python", "-m", "launcher", "report"]
    assert reporter[reporter.index("--total-steps") + 1] == "20"
    assert reporter[reporter.index("--out") + 1] == trainer.run_dir  # the results sit beside the checkpoint


def test_docker_compose_config_accepts_it():
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) and subprocess.run([*cmd, "version"], capture_output=True, timeout=60).returncode == 0:
            out = subprocess.run([*cmd, "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True,
                                 timeout=60)
            assert out.returncode == 0, out.stderr
            return
    pytest.skip("no Compose binary installed (make test-deploy installs one)")


def test_dockerfile_targets_base_and_user():
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM (\S+) AS (\w+)", text, re.M)
    assert {name for _, name in stages} == {"deps", "app", "cpu", "gpu", "ascend"}
    assert "ARG PYTHON_IMAGE=python:3.11-slim-bookworm" in text
    cpu = text.split(" AS cpu")[1].split("\nFROM ")[0]
    assert "USER 10001:10001" in cpu and 'ENTRYPOINT ["meshrl-entrypoint"]' in cpu
    kept = [line[1:] for line in (ROOT / ".dockerignore").read_text().split() if line.startswith("!")]
    for copied in re.findall(r"^COPY (?!--from)(\S+)", text, re.M):
        assert any(copied.startswith(k) for k in kept), f"{copied} is not in the build context (.dockerignore)"


def test_rollout_rank_id_is_unique_per_container(monkeypatch):
    monkeypatch.setenv("HOSTNAME", "3f2a9c01b7de")
    assert RolloutConfig().rank_id == "rollout-3f2a9c01b7de"
    monkeypatch.delenv("HOSTNAME")
    assert RolloutConfig().rank_id == "rollout-0"
    assert RolloutConfig(rank_id="r7").rank_id == "r7"


@pytest.mark.parametrize(("argv", "env", "expected"), [
    (["rollout"], {}, "services.rollout ADDR=10.9.8.7:50051 HOST="),
    (["rollout"], {"POD_IP": "10.0.0.5"}, "services.rollout ADDR=10.0.0.5:50051 HOST="),
    (["trainer", "--config", "x.yaml"], {}, "services.trainer --config x.yaml ADDR= HOST=10.9.8.7"),
    (["trainer"], {"MESHRL_TRAINER__WEIGHT_HOST": "trainer"}, "services.trainer ADDR= HOST=trainer"),
    (["echo", "as", "given"], {}, "as given"),
])
def test_entrypoint_picks_the_service_and_its_reachable_address(tmp_path, argv, env, expected):
    """deploy/docker/entrypoint.sh with a stand-in `python` that reports what it was asked to run."""
    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\nif [ "$1" = -c ]; then echo 10.9.8.7; exit; fi\nshift  # -m\n'
                    'echo "$* ADDR=$MESHRL_ROLLOUT__GRPC_ADDRESS HOST=$MESHRL_TRAINER__WEIGHT_HOST"\n')
    stub.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MESHRL_", "POD_IP"))}
    out = subprocess.run(["sh", str(ROOT / "deploy" / "docker" / "entrypoint.sh"), *argv], capture_output=True,
                         text=True, env={**clean, **env, "PATH": f"{tmp_path}:{clean['PATH']}"}, check=True).stdout
    assert out.strip() == expected


def test_only_the_reward_container_may_build_the_code_sandbox(compose):
    """F10(c): bubblewrap needs unshare, mount and a fresh /proc, which Docker's default seccomp and AppArmor
    profiles and its masked /proc refuse; the reward container alone is let (its programs run under the sandbox's
    own seccomp filter), every other container keeps Docker's defaults."""
    for name, spec in compose["services"].items():
        opts = set(spec.get("security_opt") or [])
        if name == "reward":
            assert opts == {"seccomp=unconfined", "apparmor=unconfined", "systempaths=unconfined"}
        else:
            assert not opts, f"{name} relaxes Docker's defaults: {opts}"
        assert not spec.get("privileged") and not spec.get("cap_add"), name


def test_every_runtime_image_installs_bubblewrap_and_a_system_python():
    stages = re.split(r"^FROM ", DOCKERFILE.read_text(), flags=re.M)[1:]
    runtime = {stage.split()[2]: stage for stage in stages if stage.split()[2] in ("cpu", "gpu", "ascend")}
    assert set(runtime) == {"cpu", "gpu", "ascend"}
    for name, stage in runtime.items():
        assert re.search(r"apt-get install[^\n]*\\?\n?[^\n]*bubblewrap", stage), f"{name} lacks bubblewrap"
    assert "ln -s /usr/local/bin/python3 /usr/bin/python3" in runtime["cpu"]  # the sandbox's interpreter
