"""The Stack's supervision with real processes: NATS (single and cluster) restarted after a kill, JetStream data
kept, watch_run across a NATS restart, and the five services' configs and restarts (dummy processes stand in
for the services, which other tests start for real)."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time

import nats
import pytest
import yaml
from nats.js.api import StorageType

from launcher.processes import NatsCluster
from launcher.report import EventLog
from launcher.runconfig import RunConfig
from launcher.stack import SERVICES, Stack, random_ports
from launcher.supervisor import Backoff
from launcher.watch import watch_run
from services.common.contracts import data_pb2
from tests.launcher.nats_helpers import quiet, retry

FAST = Backoff(initial=0.2, factor=2, cap=1.0, reset_after=60)



async def _wait(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.02)



async def test_killed_nats_is_restarted_on_its_port_with_its_jetstream_data(tmp_path):
    stack = Stack(tmp_path / "run", random_ports(), policy=FAST)
    stack.start_nats()
    try:
        nc = await nats.connect(stack.nats.url, error_cb=quiet, **stack.nats_connect_options)
        js = nc.jetstream(timeout=3.0)
        await js.add_stream(name="KEEP", subjects=["keep.>"], storage=StorageType.FILE)
        await js.publish("keep.a", b"before the kill")
        await nc.close()

        old = stack.pid("nats")
        assert stack.kill("nats") == "nats"
        await _wait(lambda: stack.restarts["nats"] == 1, 5)
        assert stack.pid("nats") not in (None, old)
        assert stack.restarts == {**{s: 0 for s in SERVICES}, "nats": 1}
        stack.nats.wait_listening()
        nc = await retry(lambda: nats.connect(stack.nats.url, error_cb=quiet, allow_reconnect=False,
                                                **stack.nats_connect_options))
        js = nc.jetstream(timeout=3.0)
        msg = await retry(lambda: js.get_msg("KEEP", 1))
        assert msg.data == b"before the kill"
        await nc.close()
        log = (tmp_path / "run" / "logs" / "supervisor.log").read_text()
        assert '"service": "nats"' in log and '"exit_code": -9' in log
    finally:
        codes = stack.stop()
    assert codes == {} and not stack.nats.alive
    time.sleep(0.5)
    assert not stack.nats.alive, "no restart after stop()"


@pytest.mark.parametrize("nats_mode", ["single", "cluster"])
async def test_watch_run_survives_a_nats_restart(tmp_path, nats_mode):
    stack = Stack(tmp_path / "run", random_ports(), nats_mode=nats_mode, rng=random.Random(0), policy=FAST)
    await asyncio.to_thread(stack.start_nats)
    servers = stack.nats.url.split(",")
    try:
        nc = await nats.connect(servers=servers, error_cb=quiet, **stack.nats_connect_options)
        js = nc.jetstream(timeout=3.0)
        await js.add_stream(name="EVENTS", subjects=["events.>"], storage=StorageType.FILE,
                            num_replicas=len(servers))
        await js.publish("events.version", data_pb2.VersionEvent(kind=data_pb2.VERSION_KIND_TRAINED, version=1,
                                                                 at=time.time()).SerializeToString())
        await nc.close()
        events = EventLog(tmp_path / "metrics.jsonl")
        watcher = asyncio.create_task(watch_run(stack, events, total_steps=2, timeout=25, progress=False))
        await _wait(lambda: len(events.records) == 1, 10)
        stack.kill("nats")
        await _wait(lambda: stack.restarts["nats"] == 1, 5)
        assert not watcher.done(), "a dead NATS does not end the run"
        nc = await retry(lambda: nats.connect(servers=servers, error_cb=quiet, allow_reconnect=False,
                                                **stack.nats_connect_options))
        js = nc.jetstream(timeout=3.0)
        await retry(lambda: js.publish("events.version", data_pb2.VersionEvent(
            kind=data_pb2.VERSION_KIND_RUN_END, version=2, at=time.time()).SerializeToString(),
            headers={"Nats-Msg-Id": "run-end"}))
        await nc.close()
        assert await asyncio.wait_for(watcher, 25) is True
        assert [r["kind"] for r in events.records] == ["trained", "run_end"]
    finally:
        stack.stop()


async def test_cluster_kill_nats_hits_a_seeded_random_node_and_it_comes_back(tmp_path):
    stack = Stack(tmp_path / "run", random_ports(), nats_mode="cluster", rng=random.Random(7), policy=FAST)
    assert isinstance(stack.nats, NatsCluster) and len(stack.nats.url.split(",")) == 3
    stack.start_nats()
    try:
        assert stack.nats_children == ["nats-n0", "nats-n1", "nats-n2"]
        pids = {c: stack.pid(c) for c in stack.nats_children}
        expected = random.Random(7).choice([0, 1, 2])
        victim = stack.kill("nats")
        assert victim == f"nats-n{expected}"
        await _wait(lambda: stack.restarts["nats"] == 1, 5)
        assert stack.pid(victim) not in (None, pids[victim]) and stack.pid("nats") == stack.pid(victim)
        assert all(stack.pid(c) == pids[c] for c in stack.nats_children if c != victim)
        assert stack.supervisor.restarts[victim] == 1
        await asyncio.to_thread(stack.nats.wait_jetstream, 20.0, urls=[stack.nats.nodes[expected].url])
        # an explicit rng overrides the Stack's
        assert stack.kill("nats", signal.SIGTERM, rng=random.Random(1)) == f"nats-n{random.Random(1).choice([0, 1, 2])}"
        await _wait(lambda: stack.restarts["nats"] == 2, 10)
        with pytest.raises(ValueError, match="name"):
            stack.kill("postgres")
    finally:
        stack.stop()
    assert not any(node.alive for node in stack.nats.nodes)


@pytest.mark.parametrize("nats_mode", ["single", "cluster"])
def test_stack_writes_configs_restarts_a_killed_service_and_stops_without_a_fight(tmp_path, nats_mode):
    stack = Stack(tmp_path / "run", random_ports(), nats_mode=nats_mode, policy=FAST)
    spawned: dict[str, list[subprocess.Popen]] = {s: [] for s in SERVICES}

    def fake_spawner(service, config_file, *, detach):  # a dummy in place of `python -m services.<name>`
        def spawn() -> subprocess.Popen:
            spawned[service].append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            return spawned[service][-1]
        return spawn

    stack._spawner = fake_spawner
    plan = RunConfig.from_dict({"services": {"builder": {"total_steps": 3}, "trainer": {"algo": "grpo"}}})
    stack.start(stack.derive(plan, seed=1, model_path=tmp_path / "model").files())
    try:
        for service in SERVICES:
            cfg = yaml.safe_load((tmp_path / "run" / "config" / f"{service}.yaml").read_text())
            assert cfg["nats_url"] == stack.nats.url
            if nats_mode == "cluster":
                assert len(cfg["nats_url"].split(",")) == 3 and cfg["nats_replicas"] == 3
            else:
                assert "," not in cfg["nats_url"] and cfg["nats_replicas"] == 1
        old = stack.pid("rollout")
        assert stack.kill("rollout") == "rollout"
        deadline = time.monotonic() + 5
        while stack.restarts["rollout"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stack.restarts["rollout"] == 1 and stack.pid("rollout") not in (None, old)
        assert len(spawned["rollout"]) == 2 and len(spawned["trainer"]) == 1
        assert set(stack.procs) == set(SERVICES)
        snap = stack.snapshot()
        assert snap["pids"]["rollout"] == stack.pid("rollout") and snap["restarts"]["rollout"] == 1
    finally:
        codes = stack.stop(grace=5)
    assert codes == {s: -signal.SIGTERM for s in SERVICES}, "SIGTERM once, no restart in between"
    time.sleep(0.5)
    assert stack.restarts["rollout"] == 1 and all(len(spawned[s]) == (2 if s == "rollout" else 1) for s in SERVICES)


def test_a_run_on_ports_another_stack_holds_stops_before_anything_starts(tmp_path, monkeypatch):
    """A second `meshrl run` on the default ports would share the first stack's gRPC ports without an error
    (SO_REUSEPORT) while its nats-server restarts forever: it is refused naming each held port, and the earlier
    run folder of the same name is kept."""
    import socket

    from launcher import stack as stack_module

    ports = random_ports()
    monkeypatch.setattr(stack_module, "resolve_model", lambda model, seed: "unused")
    old_run = tmp_path / "runs" / "again"
    old_run.mkdir(parents=True)
    with socket.socket() as nats_holder, socket.socket() as trainer_holder:
        for holder, name in ((nats_holder, "nats"), (trainer_holder, "trainer")):
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)   # as a gRPC server binds
            holder.bind(("127.0.0.1", ports[name]))
            holder.listen()
        with pytest.raises(SystemExit, match=rf"ports in use: trainer 127.0.0.1:{ports['trainer']}, nats "
                                             rf"127.0.0.1:{ports['nats']}\. .*--random-ports"):
            stack_module.run("configs/e2e.yaml", name="again", seed=0, ports=ports, runs_root=tmp_path / "runs")
    assert old_run.is_dir()
    assert stack_module.ports_held(ports, ["nats", "trainer"]) == []   # released: nothing in the way


def test_a_port_whose_connections_linger_in_time_wait_is_free(tmp_path):
    """A run that just ended leaves its servers' closed connections in TIME_WAIT on their ports; the next run binds
    them (gRPC and nats-server set SO_REUSEADDR), so the check must not call them held (`make run-distill-smollm2`
    runs two stacks back to back on the default ports)."""
    import socket

    from launcher import stack as stack_module

    ports = random_ports()
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", ports["trainer"]))
        server.listen()
        with socket.create_connection(("127.0.0.1", ports["trainer"]), timeout=5) as client:
            accepted, _ = server.accept()
            accepted.close()   # the server side closes first: its end of the connection stays in TIME_WAIT
            assert client.recv(1) == b""
        assert stack_module.ports_held(ports, ["trainer"]) == [f"trainer 127.0.0.1:{ports['trainer']}"]
    lingering = subprocess.run(["ss", "-tan", "state", "time-wait", f"( sport = :{ports['trainer']} )"],
                               capture_output=True, text=True, timeout=30).stdout
    assert f":{ports['trainer']}" in lingering, lingering
    assert stack_module.ports_held(ports, ["trainer"]) == []
