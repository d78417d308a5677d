"""A real three-node nats-server cluster: an R3 stream keeps taking and serving messages with one node down."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from nats.js.api import StorageType

from launcher.processes import NatsCluster, nats_server_binary
from services.common.bus import Bus
from tests.launcher.nats_helpers import quiet, retry


async def test_r3_stream_survives_a_node_down_and_the_node_comes_back(tmp_path):
    assert nats_server_binary().endswith("nats-server")
    cluster = NatsCluster(tmp_path / "nats", log_dir=tmp_path / "logs")
    assert len(cluster.url.split(",")) == 3 and cluster.url.startswith("nats://127.0.0.1:")
    cluster.start()
    nc = None
    try:
        nc = await nats.connect(servers=cluster.urls, reconnect_time_wait=0.2, max_reconnect_attempts=-1,
                                error_cb=quiet)
        js = nc.jetstream(timeout=3.0)
        await js.add_stream(name="T", subjects=["t.>"], num_replicas=3, storage=StorageType.FILE)
        for i in range(10):
            await js.publish("t.x", f"m{i}".encode(), headers={"Nats-Msg-Id": f"m{i}"})
        info = await js.stream_info("T")
        assert info.config.num_replicas == 3 and info.state.messages == 10
        # take down the stream's leader: the worst node to lose
        leader = int(info.cluster.leader.removeprefix("n"))
        cluster.kill(leader)
        assert not cluster.nodes[leader].alive
        for i in range(10, 20):  # dedupe by Nats-Msg-Id makes a retried publish safe
            await retry(lambda i=i: js.publish("t.x", f"m{i}".encode(), headers={"Nats-Msg-Id": f"m{i}"}))
        info = await retry(lambda: js.stream_info("T"))
        assert info.state.messages == 20 and info.cluster.leader != f"n{leader}"
        sub = await retry(lambda: js.pull_subscribe("t.>", durable="reader", stream="T"))
        got: list[bytes] = []
        deadline = time.monotonic() + 15
        while len(got) < 20 and time.monotonic() < deadline:
            try:
                msgs = await sub.fetch(20 - len(got), timeout=1)
            except Exception:  # nats.errors.TimeoutError while the consumer's leader settles
                continue
            for msg in msgs:
                got.append(msg.data)
                await msg.ack()
        assert got == [f"m{i}".encode() for i in range(20)]

        cluster.start_node(leader)  # same ports and store: it catches up with the 10 messages it missed
        assert cluster.nodes[leader].alive
        direct = await nats.connect(servers=[cluster.nodes[leader].url], error_cb=quiet)
        try:
            djs = direct.jetstream(timeout=3.0)

            async def caught_up():
                info = await djs.stream_info("T")
                replicas = info.cluster.replicas or []
                assert info.state.messages == 20
                assert len(replicas) == 2 and all(r.current for r in replicas), replicas
                return info

            await retry(caught_up, timeout=20)
        finally:
            await direct.close()
    finally:
        if nc is not None:
            await nc.close()
        cluster.stop()
    assert not any(node.alive for node in cluster.nodes)



async def test_more_replicas_than_nodes_is_a_clear_error_not_a_retry(tmp_path):
    cluster = NatsCluster(tmp_path / "nats", log_dir=tmp_path / "logs")
    cluster.start()
    try:
        with pytest.raises(ValueError, match="nats_replicas: JetStream cannot place 5 replicas"):
            await asyncio.wait_for(Bus.connect(cluster.url, name="t", replicas=5, deadline=600), 30)
    finally:
        cluster.stop()
