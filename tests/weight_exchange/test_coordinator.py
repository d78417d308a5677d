"""The coordinator alone (injected Apply and deployed-event callables): heartbeats, TTL, versions, catch-up."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from services.common.contracts import weight_exchange_pb2 as wx_pb2
from services.weight_exchange import coordinator as coordinator_module
from services.weight_exchange.client.layout import RECEIVER, SENDER, RankLayout, full_shard
from services.weight_exchange.coordinator import Coordinator, SyncError

SHARDS = [full_shard("w", (4, 4), "float32"), full_shard("b", (4,), "float32")]


def sender(version: int = 0, rank_id: str = "trainer-0") -> RankLayout:
    return RankLayout(rank_id, SENDER, "hf", SHARDS, endpoints={"tcp": "127.0.0.1:1"}, host="h", version=version)


def receiver(version: int = 0, rank_id: str = "rollout-0", address: str = "127.0.0.1:2") -> RankLayout:
    return RankLayout(rank_id, RECEIVER, "hf", SHARDS, agent_address=address, host="h", version=version)


class Peers:
    """Stands in for the receivers' agents: records every Apply; `fail` / `hang` name ranks that misbehave."""

    def __init__(self) -> None:
        self.applied: list[tuple[str, int]] = []
        self.deployed: list[int] = []
        self.fail: dict[str, int] = {}     # rank -> how many more Applies fail
        self.hang: set[str] = set()
        self.active = self.most_active = 0

    async def apply(self, r: RankLayout, request: wx_pb2.ApplyRequest, timeout: float) -> wx_pb2.ApplyReply:
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            await asyncio.sleep(0.01)
            if r.rank_id in self.hang:
                await asyncio.sleep(3600)
            if self.fail.get(r.rank_id, 0) > 0:
                self.fail[r.rank_id] -= 1
                raise SyncError("ABORTED", f"tcp trainer-0 -> {r.rank_id}: sender trainer-0: parameters are being "
                                           "updated; retry")
            self.applied.append((r.rank_id, request.version))
            return wx_pb2.ApplyReply(bytes_received=sum(t.num_bytes for t in request.transfers))
        finally:
            self.active -= 1

    async def on_deployed(self, version: int) -> None:
        self.deployed.append(version)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def coordinator(peers: Peers, **kw) -> Coordinator:
    return Coordinator(apply=peers.apply, on_deployed=peers.on_deployed, catch_up_delay=0.0, **kw)


async def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_heartbeat_keeps_the_plan_a_changed_layout_replaces_it():
    c = coordinator(Peers())
    c.register(sender(0))
    c.register(receiver(0))
    first = c.current_plan()
    c.register(sender(0))
    c.register(receiver(0))
    c.register(sender(1))      # the version is not part of the layout's identity
    assert c.current_plan() is first and c.ranks["trainer-0"].version == 1
    c.register(receiver(0, address="127.0.0.1:3"))     # a restarted process on another port
    assert c.current_plan() is not first and c.ranks["rollout-0"].agent_address == "127.0.0.1:3"


async def test_silent_ranks_expire():
    clock = Clock()
    peers = Peers()
    c = coordinator(peers, rank_ttl=30.0, clock=clock)
    c.register(sender(0))
    c.register(receiver(0))
    plan = c.current_plan()
    clock.now += 20
    c.register(sender(0))      # only the sender keeps beating
    clock.now += 20
    assert c.expire() == ["rollout-0"] and [r.rank_id for r in c.ranks.values()] == ["trainer-0"]
    assert c._plan is None and plan is not None
    with pytest.raises(SyncError) as err:
        await c.sync(1)
    assert err.value.code == "FAILED_PRECONDITION" and "no receiver is registered" in str(err.value)
    assert peers.applied == []
    c.register(receiver(0))    # back again: a new registration
    assert (await c.sync(1)).num_receivers == 1


async def test_ttl_zero_never_expires():
    clock = Clock()
    c = coordinator(Peers(), rank_ttl=0, clock=clock)
    c.register(receiver(0))
    clock.now += 1e9
    assert c.expire() == [] and "rollout-0" in c.ranks


async def test_sync_without_receivers_is_an_error():
    c = coordinator(Peers())
    c.register(sender(1))
    with pytest.raises(SyncError) as err:
        await c.sync(1)
    assert err.value.code == "FAILED_PRECONDITION" and "no receiver is registered" in str(err.value)


async def test_a_resumed_trainer_redeploys_older_versions_and_versions_are_tracked():
    peers = Peers()
    c = coordinator(peers)
    c.register(sender(3))      # resumed from checkpoint v3; the receiver still holds v5 of the lost lineage
    c.register(receiver(5))
    await c.sync(3)
    assert c.ranks["rollout-0"].version == 3 and len(peers.applied) == 1
    c.register(sender(5))
    await c.sync(5)            # the same version again is allowed
    c.register(receiver(5, rank_id="rollout-1", address="127.0.0.1:4"))
    peers.fail["rollout-1"] = 1
    c.register(sender(6))
    with pytest.raises(SyncError) as err:
        await c.sync(6)
    assert err.value.code == "ABORTED" and "rollout-1" in str(err.value) and "trainer-0" in str(err.value)
    assert c.ranks["rollout-0"].version == 6 and c.ranks["rollout-1"].version == 5   # each successful Apply counts


async def test_timed_out_sync_names_the_stalled_rank(monkeypatch):
    monkeypatch.setattr(coordinator_module, "GRACE", 0.2)   # the injected Apply ignores its deadline
    peers = Peers()
    c = coordinator(peers, transfer_timeout=0.1, control_timeout=0.1)
    c.register(sender(1))
    c.register(receiver(0))
    c.register(receiver(0, rank_id="rollout-1", address="127.0.0.1:4"))
    peers.hang.add("rollout-1")
    with pytest.raises(SyncError) as err:
        await asyncio.wait_for(c.sync(1), 10)
    assert err.value.code == "DEADLINE_EXCEEDED", err.value
    assert "rollout-1: no answer within" in str(err.value) and "1 of 2" in str(err.value)
    assert c.ranks["rollout-0"].version == 1 and c.ranks["rollout-1"].version == 0


async def test_restarted_receiver_is_caught_up_and_deployed():
    peers = Peers()
    c = coordinator(peers)
    c.register(sender(3))
    c.register(receiver(0))
    await wait_for(lambda: c.ranks["rollout-0"].version == 3)   # registered behind: caught up at once
    assert peers.applied == [("rollout-0", 3)] and peers.deployed == [3]
    c.register(receiver(0))    # the rollout restarted: version 0 again
    await wait_for(lambda: peers.deployed == [3, 3])
    assert peers.applied == [("rollout-0", 3)] * 2 and c.ranks["rollout-0"].version == 3
    assert c.deployed_version == 3 and c.catch_ups == 2
    c.register(receiver(3))    # a heartbeat of a current receiver: nothing to do
    await asyncio.sleep(0.1)
    assert len(peers.applied) == 2 and not c._catch_ups


async def test_catch_up_retries_while_lagging_and_never_overlaps_a_sync():
    peers = Peers()
    c = coordinator(peers)
    c.register(sender(2))
    peers.fail["rollout-0"] = 2            # e.g. the sender refuses reads while a step runs
    c.register(receiver(0))
    c.register(receiver(0))                # heartbeats while a catch-up runs start no second one
    assert len(c._catch_ups) == 1
    syncs = [asyncio.create_task(c.sync(2)) for _ in range(3)]
    await asyncio.gather(*syncs, return_exceptions=True)
    await wait_for(lambda: not c._catch_ups)
    assert peers.most_active == 1 and c.ranks["rollout-0"].version == 2
    assert ("rollout-0", 2) in peers.applied


async def test_catch_up_waits_for_senders_to_agree_and_stops_when_the_receiver_leaves():
    clock = Clock()
    peers = Peers()
    c = coordinator(peers, clock=clock)
    c.register(sender(4))
    c.register(sender(3, rank_id="trainer-1"))    # one rank still mid-step
    c.register(receiver(0))
    await asyncio.sleep(0.3)
    assert peers.applied == [] and c._catch_ups
    clock.now += 60                               # everybody went silent
    await wait_for(lambda: not c._catch_ups, timeout=35)
    assert peers.applied == [] and not c.ranks


async def test_close_cancels_catch_ups():
    peers = Peers()
    peers.hang.add("rollout-0")
    c = coordinator(peers)
    c.register(sender(1))
    c.register(receiver(0))
    await asyncio.sleep(0.05)
    await c.close()
    assert not c._catch_ups


def test_layout_version_round_trips_and_is_checked():
    layout = sender(7)
    assert RankLayout.from_proto(layout.to_proto()) == layout
    assert layout.same_except_version(dataclasses.replace(layout, version=9))
    with pytest.raises(ValueError, match=r"^layout\.version:"):
        dataclasses.replace(layout, version=-2).validate()
