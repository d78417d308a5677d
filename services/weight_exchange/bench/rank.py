"""One benchmark rank as a process, driven by JSON lines on stdin (replies on stdout).

Senders hold the reference weights sharded by their framework's rule and run a SenderAgent; rank 0 also
keeps a full-model buffer for the naive baseline. Receivers hold zeroed live tensors, the expected shard
(to check `correct` after the clock stops) and a full-model staging buffer for the naive baseline.
Commands: reset, peak, check, gather (sender 0), naive_pull (receivers), quit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import torch

from services.common.errors import FieldError
from services.common.logging import configure_logging
from services.common.rpc import LARGE_MAX_RECEIVE, start_server
from services.weight_exchange.client import ReceiverAgent, SenderAgent
from services.weight_exchange.client.layout import RECEIVER, SENDER, RankLayout
from services.weight_exchange.client.layouts.hf import hf_shards
from services.weight_exchange.client.layouts.inference import receiver_views
from services.weight_exchange.client.layouts.model import model_spec
from services.weight_exchange.client.layouts.topology import parse_side, rank_shards, side_layouts
from services.weight_exchange.client.sink import pull_all
from services.weight_exchange.client.source import SenderServer
from services.weight_exchange.planner import plan
from services.weight_exchange.reference import hf_reference, local_tensors


def rss_reset() -> int:
    """Reset the peak-RSS counter; returns the current RSS in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status("VmRSS")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


class Rank:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.spec = model_spec(a.model, a.dtype)
        self.side = parse_side(a.side)
        self.rank_id = f"{a.prefix}-{a.rank}"
        self.baseline = 0
        dtype = getattr(torch, a.dtype)
        ref = hf_reference(self.spec, a.seed, dtype, fast=True)
        self.shards, self.parallel = rank_shards(self.spec, self.side, a.rank, a.dtype)
        self.tensors = local_tensors(self.spec, self.side, a.rank, ref)
        self.full: dict[str, torch.Tensor] = {}
        self.expected: dict[str, torch.Tensor] = {}
        if a.role == "sender" and a.rank == 0:
            self.full = {k: torch.zeros_like(v) for k, v in ref.items()}
        if a.role == "receiver":
            self.expected = self.tensors
            self.tensors = {k: torch.zeros_like(v) for k, v in self.expected.items()}
            self.full = {k: torch.zeros_like(v) for k, v in ref.items()}
        del ref

    async def start(self) -> dict[str, Any]:
        a = self.a
        transports = tuple(a.transports.split(","))
        if a.role == "sender":
            self.agent = SenderAgent(self.rank_id, self.tensors, a.wx, transports=transports, shards=self.shards,
                                     framework=self.side.framework, parallel=self.parallel)
            await self.agent.start()
            out: dict[str, Any] = {"endpoints": self.agent.endpoints}
            if self.full:
                self.naive_server = SenderServer("naive-0", self.full, transport_names=transports)
                out["naive_endpoints"] = self.naive_server.start()
            return out
        self.agent = ReceiverAgent(self.rank_id, receiver_views(self.side.framework, self.tensors), a.wx,
                                   shards=self.shards, framework=self.side.framework, parallel=self.parallel)
        self.server = await start_server("127.0.0.1:0", [self.agent.servicer()], max_receive_bytes=LARGE_MAX_RECEIVE)
        await self.agent.register(f"127.0.0.1:{self.server.port}")
        return {}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["cmd"]
        if op == "reset":
            if self.a.role == "receiver":
                for t in [*self.tensors.values(), *self.full.values()]:
                    t.zero_()
            self.baseline = rss_reset()
            return {}
        if op == "peak":
            return {"peak_extra": max(0, _status("VmHWM") - self.baseline)}
        if op == "check":
            bad = [k for k, t in self.tensors.items()
                   if not torch.equal(t.view(torch.uint8), self.expected[k].view(torch.uint8))]
            return {"correct": not bad, "bad": bad[:5]}
        if op == "gather":
            return self.gather(cmd["transport"], cmd["endpoints"])
        if op == "naive_pull":
            return self.naive_pull(cmd["transport"], cmd["endpoint"])
        raise FieldError("cmd", f"unknown {op!r}")

    def gather(self, transport: str, endpoints: dict[str, str]) -> dict[str, Any]:
        """Naive step 1: assemble the full HF model on trainer rank 0 (own shards by local copy)."""
        start = time.monotonic()
        senders = side_layouts(self.spec, self.side, SENDER, self.a.prefix)
        full = RankLayout("gather-0", RECEIVER, "hf", self._full_shards(), agent_address="-")
        p = plan(senders, [full])
        local = [t for t in p.transfers if t.src == self.rank_id]
        remote = [t for t in p.transfers if t.src != self.rank_id]
        with torch.no_grad():
            for t in local:
                dst = self.full[t.dst_local][t.dst_region.slices()]
                dst.copy_(self.tensors[t.src_local][t.src_region.slices()].reshape(dst.shape))
        moved = pull_all("gather-0", self.full, remote, endpoints, transport, 600.0).bytes_received
        return {"seconds": time.monotonic() - start, "bytes": moved}

    def naive_pull(self, transport: str, endpoint: str) -> dict[str, Any]:
        """Naive step 2: receive the full model, then slice this rank's shard out of it (weight_loader style)."""
        start = time.monotonic()
        shards = self._full_shards()
        p = plan([RankLayout("naive-0", SENDER, "hf", shards, endpoints={transport: endpoint})],
                 [RankLayout(self.rank_id, RECEIVER, "hf", shards, agent_address="-")])
        moved = pull_all(self.rank_id, self.full, p.transfers, {"naive-0": endpoint}, transport, 600.0).bytes_received
        with torch.no_grad():
            for s in self.shards:
                dst = receiver_views(self.side.framework, self.tensors)[s.local_name][s.local_region.slices()]
                dst.copy_(self.full[s.canonical_name][s.canonical_region.slices()].reshape(dst.shape))
        return {"seconds": time.monotonic() - start, "bytes": moved}

    def _full_shards(self):
        return [s for name, shape in self.spec.canonical().items() for s in hf_shards(name, shape, self.a.dtype)]


MARK = "@@wx "   # replies carry this prefix: native libraries (UCX) may print to stdout too


def _reply(obj: dict[str, Any]) -> None:
    print(MARK + json.dumps(obj), flush=True)


async def main_async(a: argparse.Namespace) -> None:
    rank = Rank(a)
    info = await rank.start()
    _reply({"ready": rank.rank_id, **info})
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line or line.strip() == '{"cmd": "quit"}':
            break
        cmd = json.loads(line)
        try:
            reply = await asyncio.to_thread(rank.handle, cmd)
        except Exception as exc:  # noqa: BLE001 - reported to the driver
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        _reply(reply)
    if a.role == "sender":
        await rank.agent.close()
        if rank.full:
            rank.naive_server.stop()
    else:
        await rank.agent.close()
        await rank.server.stop(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("sender", "receiver"), required=True)
    ap.add_argument("--side", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wx", required=True)
    ap.add_argument("--transports", default="tcp,shm")
    a = ap.parse_args()
    configure_logging(f"bench-{a.role}", os.environ.get("MESHRL_WX_BENCH_LOG", "warning"))
    asyncio.run(main_async(a))


if __name__ == "__main__":
    main()
