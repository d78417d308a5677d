"""Run one benchmark case with real processes: one process per rank, the service in this process.

Measures one update through the planner (`seconds`) and the naive baseline over the same transport
(`naive_seconds`: gather the full model onto trainer rank 0, send it whole to every inference rank, each
slices its shard), the memcpy floor for `bytes_moved` in this process (right after each update), and the
peak extra memory per rank. Medians over `repeat` rounds after one warm-up round.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from services.common.contracts import common_pb2
from services.common.contracts import weight_exchange_pb2 as wx_pb2
from services.common.contracts import weight_exchange_pb2_grpc as wx_grpc
from services.common.net import free_port
from services.common.rpc import channel
from services.weight_exchange.bench.rank import MARK
from services.weight_exchange.client.layouts.model import model_spec
from services.weight_exchange.client.layouts.topology import parse_side
from services.weight_exchange.config import WeightExchangeConfig
from services.weight_exchange.server import serve

# A rank builds its model shard and registers before its ready line; a command may move the whole model (pulls
# run under the 600 s transfer timeout). Generous for a loaded 2-core machine, yet a hung rank fails the case.
START_TIMEOUT_S = 300.0
REPLY_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 60.0

@dataclasses.dataclass
class Case:
    name: str
    model: str
    src: str
    dst: str
    transports: tuple[str, ...]
    dtype: str = "bfloat16"
    repeat: int = 3
    bucket_bytes: int = 64 << 20


class RankProc:
    def __init__(self, proc: asyncio.subprocess.Process, rank_id: str) -> None:
        self.proc = proc
        self.rank_id = rank_id

    async def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        reply = await _read_reply(self.proc, self.rank_id, REPLY_TIMEOUT_S, waiting_for=f"the reply to {cmd['cmd']!r}")
        if "error" in reply:
            raise RuntimeError(f"{self.rank_id}: {reply['error']}")
        return reply


async def _spawn(role: str, side: str, rank: int, prefix: str, case: Case, wx: str, log_dir: str) -> tuple[RankProc, dict]:
    cmd = [sys.executable, "-m", "services.weight_exchange.bench.rank", "--role", role, "--side", side, "--rank",
           str(rank), "--prefix", prefix, "--model", case.model, "--dtype", case.dtype, "--wx", wx,
           "--transports", ",".join(case.transports)]
    err = open(os.path.join(log_dir, f"{prefix}-{rank}.log"), "w")
    proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=err, limit=1 << 24)
    try:
        ready = await _read_reply(proc, f"{prefix}-{rank} (see {err.name})", START_TIMEOUT_S,
                                  waiting_for="the ready line")
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # a rank that never got ready is not left behind
        raise
    return RankProc(proc, f"{prefix}-{rank}"), ready


async def _read_reply(proc: asyncio.subprocess.Process, who: str, timeout: float,
                      waiting_for: str = "a reply") -> dict[str, Any]:
    """The next reply line (MARK-prefixed) of `proc` within `timeout` seconds; TimeoutError names `who`, what it
    waited for and the last other line the rank printed."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            raw = await asyncio.wait_for(proc.stdout.readline(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise TimeoutError(f"{who}: {waiting_for} not seen within {timeout:g}s (last other output: {last!r})") from None
        line = raw.decode(errors="replace")
        if not line:
            raise RuntimeError(f"{who} exited before {waiting_for} (last other output: {last!r})")
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
        last = line.strip()[-300:] or last


class MemcpyFloor:
    """Time to copy `num_bytes` once in this process (torch copy_, as the transports do), measured each round
    right after the update so both see the same machine load."""

    def __init__(self, num_bytes: int) -> None:
        self.src = torch.ones(num_bytes, dtype=torch.uint8)
        self.dst = torch.ones(num_bytes, dtype=torch.uint8)

    def measure(self, repeat: int = 2) -> float:
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            self.dst.copy_(self.src)
            best = min(best, time.perf_counter() - start)
        return best


async def run_case(case: Case, log_dir: str = "/tmp") -> list[dict[str, Any]]:
    """Start the ranks, measure every transport of the case; one result dict per transport."""
    os.makedirs(log_dir, exist_ok=True)
    spec = model_spec(case.model, case.dtype)
    src, dst = parse_side(case.src), parse_side(case.dst)
    address = f"127.0.0.1:{free_port()}"
    stop = asyncio.Event()
    config = WeightExchangeConfig(grpc_address=address, nats_url="", metrics_port=-1, bucket_bytes=case.bucket_bytes,
                                  transfer_timeout=600.0, default_transport=case.transports[0],
                                  rank_ttl=0)   # the ranks register once (no heartbeats while the clock runs)
    service = asyncio.create_task(serve(config, stop))
    await asyncio.sleep(0.2)
    procs: list[RankProc] = []
    try:
        started = await asyncio.gather(*[_spawn("sender", case.src, r, "src", case, address, log_dir)
                                         for r in range(src.world)],
                                       *[_spawn("receiver", case.dst, r, "dst", case, address, log_dir)
                                         for r in range(dst.world)])
        procs = [p for p, _ in started]
        senders, receivers = procs[:src.world], procs[src.world:]
        infos = [info for _, info in started]
        async with channel(address) as ch:
            stub = wx_grpc.WeightExchangeServiceStub(ch)
            stats = (await stub.Plan(wx_pb2.PlanRequest(), timeout=60)).stats
            results = []
            for transport in case.transports:
                results.append(await _measure(case, transport, stub, stats, spec.num_params() * _itemsize(case.dtype),
                                              senders, receivers, infos[:src.world]))
            return results
    finally:
        for p in procs:
            with contextlib.suppress(Exception):
                p.proc.stdin.write(b'{"cmd": "quit"}\n')  # type: ignore[union-attr]
                await asyncio.wait_for(p.proc.wait(), 20)
            if p.proc.returncode is None:
                p.proc.kill()
        stop.set()
        try:
            await asyncio.wait_for(service, STOP_TIMEOUT_S)
        except TimeoutError:
            raise TimeoutError(f"the weight-exchange service at {address} did not stop within "
                               f"{STOP_TIMEOUT_S:g}s") from None


async def _measure(case: Case, transport: str, stub: Any, stats: Any, model_bytes: int, senders: list[RankProc],
                   receivers: list[RankProc], sender_infos: list[dict]) -> dict[str, Any]:
    everyone = senders + receivers
    floor = MemcpyFloor(stats.total_bytes)
    ours, naive, floors, peaks, naive_peaks, correct = [], [], [], [], [], True
    gather_bytes = 0
    status = await stub.Status(common_pb2.StatusRequest(), timeout=60)
    version = status.deployed_version + 1     # a fresh version per case
    for i in range(case.repeat + 1):          # the first round warms up (plan cache, connections)
        await asyncio.gather(*[p.call({"cmd": "reset"}) for p in everyone])
        start = time.perf_counter()
        reply = await stub.Sync(wx_pb2.SyncRequest(version=version + i, transport=transport), timeout=900)
        seconds = time.perf_counter() - start
        floor_seconds = floor.measure()
        peak = max([(await p.call({"cmd": "peak"}))["peak_extra"] for p in everyone])
        checks = [await p.call({"cmd": "check"}) for p in receivers]
        correct &= all(c["correct"] for c in checks) and reply.bytes_moved == stats.bytes_min
        await asyncio.gather(*[p.call({"cmd": "reset"}) for p in everyone])
        start = time.perf_counter()
        endpoints = {f"src-{r}": info["endpoints"][transport] for r, info in enumerate(sender_infos)}
        gathered = await senders[0].call({"cmd": "gather", "transport": transport, "endpoints": endpoints})
        naive_ep = sender_infos[0]["naive_endpoints"][transport]
        await asyncio.gather(*[p.call({"cmd": "naive_pull", "transport": transport, "endpoint": naive_ep})
                               for p in receivers])
        naive_seconds = time.perf_counter() - start
        naive_peak = max([(await p.call({"cmd": "peak"}))["peak_extra"] for p in everyone])
        naive_checks = [await p.call({"cmd": "check"}) for p in receivers]
        correct &= all(c["correct"] for c in naive_checks)
        gather_bytes = gathered["bytes"]
        if i:
            ours.append(seconds)
            naive.append(naive_seconds)
            floors.append(floor_seconds)
            peaks.append(peak)
            naive_peaks.append(naive_peak)
    seconds, naive_seconds = statistics.median(ours), statistics.median(naive)
    moved = stats.total_bytes
    return {
        "case": case.name, "src": case.src, "dst": case.dst, "transport": transport, "model_bytes": model_bytes,
        "bytes_moved": moved, "bytes_min": stats.bytes_min,
        "naive_bytes": gather_bytes + len(receivers) * model_bytes,
        "seconds": round(seconds, 4), "naive_seconds": round(naive_seconds, 4),
        "speedup_vs_naive": round(naive_seconds / seconds, 2), "gbps": round(moved / seconds / 1e9, 3),
        "memcpy_floor_seconds": round(statistics.median(floors), 4), "peak_extra_bytes": max(peaks),
        # the naive plan also needs a full-model buffer on trainer rank 0 and on every inference rank (allocated
        # before the clock starts, so not in the measured peak)
        "naive_peak_extra_bytes": max(naive_peaks) + model_bytes, "correct": bool(correct),
    }


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()
