"""The dangerous RPCs hardened and the launcher's credentials: Checkpoint stays inside the run directory, a live
rank is never taken over by another identity, credentials are generated once (0600), reused by restarts and never
written into configs."""

from __future__ import annotations

import json
import stat
import subprocess
import sys

import grpc
import pytest
import yaml

from launcher.runconfig import RunConfig
from launcher.stack import SERVICES, Stack, random_ports
from services.common.auth import OPERATOR, server_security
from services.common.config import ServiceConfig
from services.common.contracts import trainer_pb2, trainer_pb2_grpc
from services.common.credentials import RunCredentials
from services.common.rpc import Servicer, start_server
from services.trainer.server import TrainerServicer, confined_checkpoint_path
from services.weight_exchange.client.layout import RECEIVER, RankLayout
from services.weight_exchange.client.layouts.hf import hf_full_shards
from services.weight_exchange.coordinator import Coordinator, RegisterDenied


def make_checkpoint(path):
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")


def test_checkpoint_paths_are_confined_to_the_run_directory(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "logs").mkdir()
    (run / "notes").mkdir()
    make_checkpoint(run / "checkpoints" / "v3")
    (tmp_path / "elsewhere").mkdir()
    (run / "escape").symlink_to(tmp_path / "elsewhere")
    assert confined_checkpoint_path(run, "exports/a") == (run / "exports" / "a").resolve()
    assert confined_checkpoint_path(run, str(run / "b")) == (run / "b").resolve()
    assert confined_checkpoint_path(run, "checkpoints/v3") == (run / "checkpoints" / "v3").resolve()  # a checkpoint
    for bad in ("/etc/passwd", "/tmp/x", "../x", "a/../../x", ".", "", "..", str(run), "escape/x", "escape",
                "logs/x", "secrets", "nats/js", "config/trainer.yaml", "notes"):
        with pytest.raises(ValueError):
            confined_checkpoint_path(run, bad)


class FakeTrainer:
    def __init__(self, run_dir) -> None:
        self.run_dir = run_dir
        self.version = 4
        self.paths: list[str] = []

    async def checkpoint(self, path: str = ""):
        self.paths.append(path)
        return path or str(self.run_dir / "checkpoints" / "v4")


async def test_checkpoint_rpc_refuses_paths_outside_the_run_directory(tmp_path):
    creds = RunCredentials.ensure(tmp_path / "secrets")
    trainer = FakeTrainer(tmp_path / "run")
    trainer.run_dir.mkdir()
    config = ServiceConfig(**creds.service_config("trainer"))
    server = await start_server("127.0.0.1:0", [Servicer(trainer_pb2_grpc.add_TrainerServiceServicer_to_server,
                                                         TrainerServicer(trainer), "meshrl.v1.TrainerService")],
                                security=server_security(config))
    metadata = (("authorization", f"Bearer {creds.token(OPERATOR)}"),)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = trainer_pb2_grpc.TrainerServiceStub(ch)
            for bad in ("/tmp/meshrl-ckpt", "../../outside", str(tmp_path)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Checkpoint(trainer_pb2.CheckpointRequest(path=bad), metadata=metadata, timeout=5)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "path:" in err.value.details()
            reply = await stub.Checkpoint(trainer_pb2.CheckpointRequest(path="exports/e1"), metadata=metadata)
            assert reply.path == str((trainer.run_dir / "exports" / "e1").resolve())
            await stub.Checkpoint(trainer_pb2.CheckpointRequest(), metadata=metadata)
    finally:
        await server.stop(0)
    assert trainer.paths == [str((trainer.run_dir / "exports" / "e1").resolve()), ""]


def receiver(address: str) -> RankLayout:
    import torch

    return RankLayout("rollout-0", RECEIVER, "hf", hf_full_shards({"w": torch.zeros(2)}), agent_address=address)


def test_a_live_rank_is_not_replaced_by_another_identity_until_it_expires():
    now = [0.0]
    c = Coordinator(apply=None, rank_ttl=10.0, clock=lambda: now[0])
    c.register(receiver("127.0.0.1:1"), key="aa" * 32, owner="rollout")
    c.register(receiver("127.0.0.1:2"), key="bb" * 32, owner="rollout")   # a restart of the same identity
    with pytest.raises(RegisterDenied, match="rollout-0"):
        c.register(receiver("127.0.0.1:3"), key="cc" * 32, owner="reward")
    assert c.ranks["rollout-0"].agent_address == "127.0.0.1:2"
    now[0] = 11.0   # silent past its TTL: gone, the name is free again
    c.register(receiver("127.0.0.1:3"), key="cc" * 32, owner="reward")
    with pytest.raises(ValueError, match="rank_key"):
        c.register(receiver("127.0.0.1:3"), key="zz", owner="reward")


def test_run_credentials_are_private_generated_once_and_kept(tmp_path):
    creds = RunCredentials.ensure(tmp_path / "secrets")
    assert stat.S_IMODE(creds.directory.stat().st_mode) == 0o700
    files = sorted(creds.directory.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    before = {f.name: f.read_text() for f in files}
    again = RunCredentials.ensure(tmp_path / "secrets")               # a restart reads the same
    assert {f.name: f.read_text() for f in sorted(again.directory.iterdir())} == before
    tokens = {i: creds.token(i) for i in ("builder", "trainer", "operator")}
    assert len(set(tokens.values())) == 3
    peers = json.loads(creds.peers_file.read_text())
    assert not any(t in creds.peers_file.read_text() for t in tokens.values()) and set(peers) >= set(tokens)


def test_stack_gives_each_service_its_own_credentials_by_path_only(tmp_path):
    stack = Stack(tmp_path / "run", random_ports())

    def fake_spawner(service, config_file, *, detach):
        return lambda: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    stack._spawner = fake_spawner
    plan = RunConfig.from_dict({"services": {"builder": {"total_steps": 1}}})
    stack.start(stack.derive(plan, seed=0, model_path=tmp_path / "model").files())
    try:
        secrets_dir = tmp_path / "run" / "secrets"
        values = [f.read_text().strip() for f in secrets_dir.iterdir() if f.suffix in (".token", ".password")]
        for service in SERVICES:
            text = (tmp_path / "run" / "config" / f"{service}.yaml").read_text()
            cfg = yaml.safe_load(text)
            assert cfg["auth_token_file"].endswith(f"grpc-{service}.token") and cfg["nats_user"] == service
            assert not any(v in text for v in values), f"{service}.yaml holds a secret"
        conf = secrets_dir / "nats.conf"
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600
        assert {u["user"] for u in json.loads(conf.read_text())["authorization"]["users"]} == {*SERVICES, OPERATOR}
        assert stack.operator_token == (secrets_dir / "grpc-operator.token").read_text().strip()
    finally:
        stack.stop(grace=5)
    logs = "".join(f.read_text(errors="replace") for f in (tmp_path / "run" / "logs").glob("*.log"))
    assert not any(v in logs for v in values)


def test_admin_key_file_on_a_read_only_mount(tmp_path, monkeypatch):
    """A Kubernetes Secret mount is root-owned and read-only: a group-readable key is trusted as it is, a key every
    user may read is refused, naming the field; a key file that can be tightened is tightened."""
    import os

    from services.rollout.gateway.config import read_or_create_key

    key = tmp_path / "gateway_admin_key"
    key.write_text("sk-meshrl-admin-" + "x" * 40 + "\n")
    os.chmod(key, 0o644)
    assert read_or_create_key(key).startswith("sk-meshrl-admin-")
    assert key.stat().st_mode & 0o777 == 0o600

    def read_only(*_args, **_kwargs):
        raise PermissionError("read-only file system")

    os.chmod(key, 0o640)
    monkeypatch.setattr(os, "chmod", read_only)
    assert read_or_create_key(key).startswith("sk-meshrl-admin-")
    monkeypatch.undo()
    os.chmod(key, 0o644)
    monkeypatch.setattr(os, "chmod", read_only)
    with pytest.raises(ValueError, match="admin_key_file: .* readable by every user"):
        read_or_create_key(key)


def test_route_urls_name_the_field_on_bad_input(tmp_path):
    from services.common.credentials import RunCredentials, route_urls

    creds = RunCredentials.ensure(tmp_path / "secrets")
    (url,) = route_urls(creds, ["nats-route://nats-0.nats-headless:6222"])
    assert url.startswith("nats-route://route:") and url.endswith("@nats-0.nats-headless:6222")
    for bad in ("nats-0:6222", "nats-route://", "nats-route://u:p@nats-0:6222"):
        with pytest.raises(ValueError, match="nats_routes: "):
            route_urls(creds, [bad])


async def test_bus_connect_with_a_refused_user_fails_fast_naming_the_field(tmp_path):
    """nats-py retries a refused user forever; Bus.connect ends with an error naming nats_user instead of hanging
    (a service with a wrong password exits and says why)."""
    import time

    from launcher.processes import NatsServer
    from services.common.bus import Bus, NatsAuthError

    creds = RunCredentials.ensure(tmp_path / "secrets")
    server = NatsServer(tmp_path / "nats", authorization=creds.nats_authorization(),
                        config_path=tmp_path / "nats.conf")
    server.start()
    try:
        started = time.monotonic()
        with pytest.raises(NatsAuthError, match="nats_user: .*'builder'"):
            await Bus.connect(server.url, name="t", deadline=60, user="builder", password="wrong")
        with pytest.raises(NatsAuthError, match="nats_user: "):
            await Bus.connect(server.url, name="t", deadline=60)
        assert time.monotonic() - started < 30
        bus = await Bus.connect(server.url, name="t", deadline=60, **creds.bus_options("builder"))
        await bus.close()
    finally:
        server.stop()
