"""The sender's data server before the ticket: what a peer without one can make it hold.

A real SenderServer on loopback, raw sockets for the attacker and the real pull path (pull_all) for the receiver.
"""

from __future__ import annotations

import socket
import struct
import time

import pytest
import torch

from services.weight_exchange.client.layout import RECEIVER, SENDER, RankLayout
from services.weight_exchange.client.layouts.hf import hf_full_shards
from services.weight_exchange.client.sink import pull_all
from services.weight_exchange.client.source import SenderServer
from services.weight_exchange.client.tickets import new_key, new_sync_id, ticket
from services.weight_exchange.planner import plan

VERSION = 3


def params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(64, 32, generator=gen), "b.weight": torch.randn(128, generator=gen)}


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def connect(endpoint: str) -> socket.socket:
    host, port = endpoint.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Whether the sender closes `sock` within `within` seconds (EOF or reset)."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def pull(server: SenderServer, endpoint: str, key: bytes) -> int:
    into = {k: torch.zeros_like(v) for k, v in server.tensors.items()}
    src = RankLayout(server.rank_id, SENDER, "hf", hf_full_shards(server.tensors), endpoints={"tcp": endpoint})
    dst = RankLayout("rollout-0", RECEIVER, "hf", hf_full_shards(into), agent_address="-")
    sync_id = new_sync_id()
    result = pull_all("rollout-0", into, plan([src], [dst]).transfers, {server.rank_id: endpoint}, "tcp", 10.0,
                      version=VERSION, tickets={server.rank_id: ticket(key, "rollout-0", VERSION, sync_id)},
                      sync_id=sync_id)
    assert all(torch.equal(into[k], server.tensors[k]) for k in into)
    return result.bytes_received


@pytest.fixture
def sender():
    key = new_key()
    server = SenderServer("trainer-0", params(), key=key, max_unverified=4, handshake_timeout=30.0)
    endpoint = server.start()["tcp"]
    server.end_update(VERSION)
    try:
        yield server, endpoint, key
    finally:
        server.stop()


def test_frames_announcing_256_mib_before_a_ticket_allocate_nothing_and_are_closed(sender):
    """Eight peers each announce a 256 MiB first frame: the sender takes none of it (it used to zero-fill a
    256 MiB buffer per connection, holding it for 30 s) and closes them at once; a ticketed pull still works."""
    server, endpoint, key = sender
    before = rss()
    socks = [connect(endpoint) for _ in range(8)]
    try:
        for s in socks:
            s.sendall(struct.pack("!I", 256 << 20))
        peak, deadline = rss(), time.monotonic() + 2.0
        while time.monotonic() < deadline:      # sample while the sender would hold the buffers
            peak = max(peak, rss())
            time.sleep(0.05)
        assert peak - before < 64 << 20, f"RSS grew by {(peak - before) >> 20} MiB"
        assert all(closed_by_peer(s, within=2.0) for s in socks)
    finally:
        for s in socks:
            s.close()
    assert pull(server, endpoint, key) > 0


def test_connections_over_the_unverified_cap_are_closed_and_slots_come_back(sender):
    """Peers that connect and send nothing hold at most `max_unverified` slots; one more is closed at once, and
    once they leave, a ticketed pull is served again."""
    server, endpoint, key = sender
    idle = [connect(endpoint) for _ in range(server.max_unverified)]
    time.sleep(0.2)                             # let the sender accept them all
    extra = connect(endpoint)
    try:
        assert closed_by_peer(extra, within=2.0)
        assert not closed_by_peer(idle[0], within=0.2)
    finally:
        extra.close()
        for s in idle:
            s.close()
    deadline = time.monotonic() + 5.0
    while server._unverified and time.monotonic() < deadline:   # the serving threads see the EOF
        time.sleep(0.02)
    assert pull(server, endpoint, key) > 0


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_connections, max_unverified"):
        SenderServer("trainer-0", params(), max_unverified=0)
    with pytest.raises(ValueError, match="handshake_timeout"):
        SenderServer("trainer-0", params(), handshake_timeout=0)
