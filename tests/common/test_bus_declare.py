"""Declaring the streams: byte caps against a nats-server whose file store is smaller than the default budget,
and which refusals are retried."""

from __future__ import annotations

import json
import time
import types

import nats.js.errors
import pytest

from launcher.processes import NatsServer, nats_server_binary
from services.common.bus import CONSUMERS, DEFAULT_MAX_BYTES, STREAMS, Bus, retry

STORE = 256 << 20


class SmallStoreNats(NatsServer):
    """A nats-server whose JetStream may keep STORE bytes on disk (a small volume, or a full one)."""

    def command(self) -> list[str]:
        conf = self.store.parent / "small-store.conf"
        conf.write_text(json.dumps({"listen": f"127.0.0.1:{self.port}",
                                    "jetstream": {"store_dir": str(self.store), "max_file_store": STORE}}))
        return [nats_server_binary(), "-c", str(conf)]


@pytest.fixture
def small_store(tmp_path):
    server = SmallStoreNats(tmp_path / "nats")
    server.start()
    yield server
    server.stop()


async def caps(bus: Bus) -> dict[str, int]:
    return {s.config.name: s.config.max_bytes for s in await bus.js.streams_info()}


async def test_a_budget_over_the_servers_store_is_a_clear_error_at_once(small_store):
    assert DEFAULT_MAX_BYTES > STORE
    started = time.monotonic()
    with pytest.raises(ValueError, match="nats_max_bytes: the JetStream server cannot reserve") as err:
        await Bus.connect(small_store.url, name="test", deadline=30.0)
    assert "max_file_store" in str(err.value)
    assert time.monotonic() - started < 10.0, "a refused reservation is not retried until the deadline"


async def test_a_budget_that_fits_is_split_between_the_capped_streams(small_store):
    budget = 200 << 20
    bus = await Bus.connect(small_store.url, name="test", max_bytes=budget)
    try:
        got = await caps(bus)
        assert got["PROMPTS"] == -1  # a work queue: acked prompts leave it
        assert got["TRAJ"] == int(0.3 * budget) and got["BATCHES"] == int(0.45 * budget)
        assert sum(v for v in got.values() if v > 0) <= budget
        assert set(got) == {s.name for s in STREAMS}
    finally:
        await bus.close()


async def test_no_caps_reserve_nothing_and_a_reader_leaves_the_streams_as_declared(small_store):
    bus = await Bus.connect(small_store.url, name="service", max_bytes=-1)
    try:
        assert set((await caps(bus)).values()) == {-1}
    finally:
        await bus.close()
    reader = await Bus.connect(small_store.url, name="audit", declare=False)  # its default budget would not fit
    try:
        assert set((await caps(reader)).values()) == {-1}
    finally:
        await reader.close()


@pytest.mark.parametrize("max_bytes", [0, 1 << 20, -2])
def test_a_budget_under_the_least_is_refused_naming_the_field(max_bytes):
    with pytest.raises(ValueError, match="nats_max_bytes"):
        Bus(None, max_bytes=max_bytes)  # type: ignore[arg-type]  # checked before the connection is used


class RefusingJetStream:
    """The two declaring calls of JetStream's manager; the first `add_stream` is refused with the error (code,
    err_code, description) a cluster's meta leader answers while it still counts a node offline."""

    def __init__(self, refusal: dict) -> None:
        self.refusal: dict | None = refusal
        self.streams: list[str] = []
        self.consumers: list[str] = []

    async def add_stream(self, config) -> None:
        if self.refusal is not None:
            refusal, self.refusal = self.refusal, None
            nats.js.errors.APIError.from_error(refusal)
        self.streams.append(config.name)

    async def add_consumer(self, stream: str, config) -> None:
        self.consumers.append(config.durable_name)


def bus_over(js: RefusingJetStream, replicas: int) -> Bus:
    return Bus(types.SimpleNamespace(jetstream=lambda timeout: js), replicas=replicas)  # type: ignore[arg-type]


async def test_a_node_still_counted_offline_is_retried_until_the_streams_are_placed():
    # the refusal itself cannot be caused on demand with real servers (it lasts a moment after a node joins)
    js = RefusingJetStream({"code": 400, "err_code": 10005,
                            "description": "no suitable peers for placement, peer offline"})
    await retry(bus_over(js, replicas=3).ensure, what="declare streams", deadline=10.0)
    assert js.streams == [s.name for s in STREAMS] and js.consumers == list(CONSUMERS)


async def test_no_suitable_peers_without_an_offline_one_is_not_retried():
    js = RefusingJetStream({"code": 400, "err_code": 10005, "description": "no suitable peers for placement"})
    with pytest.raises(ValueError, match="nats_replicas: JetStream cannot place 5 replicas of stream PROMPTS"):
        await retry(bus_over(js, replicas=5).ensure, what="declare streams", deadline=10.0)
    assert js.streams == []
