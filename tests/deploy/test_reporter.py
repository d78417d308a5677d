"""launcher/reporter.py (`python -m launcher report`) and services/common/healthcheck.py, against a real nats-server
and real gRPC servers on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from launcher import reporter
from services.common import healthcheck
from services.common.bus import SUBJECT_VERSIONS, Bus
from services.common.contracts import data_pb2, reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc


class Rollout(rollout_pb2_grpc.RolloutServiceServicer):
    def Status(self, request, context):  # noqa: N802
        return rollout_pb2.RolloutStatus(trajectories_published=96, weight_updates=3)


class Reward(reward_pb2_grpc.RewardServiceServicer):
    def Status(self, request, context):  # noqa: N802
        return reward_pb2.RewardStatus(scored=96)


@pytest.fixture
def grpc_servers():
    """A rollout and a reward stand-in (Status only) and a health servicer, on loopback."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(Rollout(), server)
    reward_pb2_grpc.add_RewardServiceServicer_to_server(Reward(), server)
    status = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", status
    server.stop(0)


async def publish_run(url: str, steps: int) -> None:
    bus = await Bus.connect(url, name="test-run", deadline=30)
    now = time.time()
    events = [data_pb2.VersionEvent(version=0, kind=data_pb2.VERSION_KIND_EVAL, at=now, metrics={"accuracy": 0.2})]
    events += [data_pb2.VersionEvent(version=v, kind=data_pb2.VERSION_KIND_TRAINED, at=now + v,
                                     metrics={"reward_mean": 0.1 * v}) for v in range(1, steps + 1)]
    events += [data_pb2.VersionEvent(version=steps, kind=data_pb2.VERSION_KIND_EVAL, at=now + steps + 1,
                                     metrics={"accuracy": 0.5, "final": 1.0}),
               data_pb2.VersionEvent(version=steps, kind=data_pb2.VERSION_KIND_RUN_END, at=now + steps + 2)]
    for i, event in enumerate(events):
        await bus.publish(SUBJECT_VERSIONS, event, f"e{i}")
    await bus.close()


async def purge_events(url: str) -> None:
    bus = await Bus.connect(url, name="test-purge", deadline=30)
    await bus.js.purge_stream("EVENTS")
    await bus.close()


def test_report_follows_the_run_to_its_end_and_writes_results(nats_server, grpc_servers, tmp_path):
    address, _ = grpc_servers
    asyncio.run(publish_run(nats_server.url, 3))
    out = tmp_path / "results"
    (out).mkdir()
    (out / "metrics.jsonl").write_text('{"stale": true}\n')  # a restarted reporter rewrites, never appends
    summary = reporter.report(nats_server.url, out, total_steps=3, timeout=60, progress=False,
                              addresses={"rollout": address, "reward": address, "builder": "127.0.0.1:1",
                                         "trainer": "127.0.0.1:1"})
    assert summary["completed"] and summary["steps"] == 3
    assert (summary["eval_accuracy_before"], summary["eval_accuracy_after"]) == (0.2, 0.5)
    assert summary["replicas"] == {"rollout": [{"address": address, "trajectories_published": 96}],
                                   "reward": [{"address": address, "scored": 96}]}
    assert summary["trajectories_generated"] == 96 and summary["wall_seconds"] == 5.0
    assert json.loads((out / "summary.json").read_text())["completed"] is True
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 6
    assert (out / "reward_accuracy.png").stat().st_size > 0


def test_report_times_out_without_a_run_end(nats_server, tmp_path):
    asyncio.run(publish_run(nats_server.url, 0))  # declares the streams
    asyncio.run(purge_events(nats_server.url))
    summary = reporter.report(nats_server.url, tmp_path, total_steps=3, timeout=2, progress=False,
                              addresses={s: "127.0.0.1:1" for s in reporter.DEFAULT_ADDRESSES})
    assert summary["completed"] is False and summary["replicas"]["rollout"][0]["error"] == "UNAVAILABLE"


def test_replica_addresses_lists_every_address_of_a_name():
    assert reporter.replica_addresses("127.0.0.1:50051") == ["127.0.0.1:50051"]
    assert reporter.replica_addresses("localhost:7") == ["127.0.0.1:7"]
    assert reporter.replica_addresses("no-such-host.invalid:7") == ["no-such-host.invalid:7"]


def test_healthcheck_exits_zero_only_when_serving(grpc_servers, capsys):
    address, status = grpc_servers
    assert healthcheck.main([address]) == 0 and capsys.readouterr().out.strip() == "SERVING"
    status.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main([address]) == 1 and capsys.readouterr().out.strip() == "NOT_SERVING"
    assert healthcheck.main(["127.0.0.1:1", "--timeout", "1"]) == 1
    port = address.rsplit(":", 1)[1]
    assert healthcheck.resolve(f":{port}") == f"{socket.gethostbyname(socket.gethostname())}:{port}"
    with pytest.raises(ValueError, match="address"):
        healthcheck.resolve("no-port")
