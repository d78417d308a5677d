"""Run a sender side and a receiver side as real processes against an in-test weight-exchange service."""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import subprocess
import sys
import time

from launcher.processes import free_port
from services.common.contracts import weight_exchange_pb2 as wx_pb2
from services.common.contracts import weight_exchange_pb2_grpc as wx_grpc
from services.common.rpc import channel
from services.weight_exchange.client.layouts.topology import parse_side
from services.weight_exchange.config import WeightExchangeConfig
from services.weight_exchange.server import serve

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _spawn(role: str, side: str, ranks: list[int], prefix: str, model: str, wx: str, out: pathlib.Path,
           transports: str, dtype: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tests.weight_exchange.rank_proc", "--role", role, "--side", side, "--ranks",
           ",".join(map(str, ranks)), "--prefix", prefix, "--model", model, "--wx", wx, "--out", str(out),
           "--transports", transports, "--dtype", dtype]
    return subprocess.Popen(cmd, cwd=ROOT, stderr=open(out / f"{prefix}.log", "w"))


@contextlib.asynccontextmanager
async def exchange(tmp: pathlib.Path, model: str, src: str, dst: str, *, transports: str = "tcp,shm,gloo",
                   dtype: str = "float32", bucket_bytes: int = 64 << 20, sender_procs: int = 1):
    """Yields a Sync function: `await sync(version, transport) -> (SyncReply, {rank_id: bad tensor names})`."""
    address = f"127.0.0.1:{free_port()}"
    stop = asyncio.Event()
    config = WeightExchangeConfig(grpc_address=address, nats_url="", metrics_port=-1, bucket_bytes=bucket_bytes,
                                  transfer_timeout=60.0)
    task = asyncio.create_task(serve(config, stop))
    src_side, dst_side = parse_side(src), parse_side(dst)
    procs = []
    groups = [list(range(src_side.world))[i::sender_procs] for i in range(sender_procs)]
    for i, ranks in enumerate(groups):
        procs.append(_spawn("sender", src, ranks, f"src{i}", model, address, tmp, transports, dtype))
    procs.append(_spawn("receiver", dst, list(range(dst_side.world)), "dst", model, address, tmp, transports, dtype))
    prefixes = [f"src{i}" for i in range(sender_procs)] + ["dst"]
    try:
        deadline = time.monotonic() + 120
        while not all((tmp / f"{p}.ready").exists() for p in prefixes):
            for p, proc in zip(prefixes, procs, strict=True):
                assert proc.poll() is None, (tmp / f"{p}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "ranks not ready after 120 s: " + "; ".join(
                f"{p}: {(tmp / f'{p}.log').read_text()[-1000:]!r}" for p in prefixes if not (tmp / f"{p}.ready").exists())
            await asyncio.sleep(0.1)
        async with channel(address) as ch:
            stub = wx_grpc.WeightExchangeServiceStub(ch)

            async def sync(version: int, transport: str, verify: bool = False):
                reply = await stub.Sync(wx_pb2.SyncRequest(version=version, transport=transport, verify=verify),
                                        timeout=120)
                bad = {}
                for r in range(dst_side.world):
                    bad[f"dst-{r}"] = json.loads((tmp / f"dst-{r}.v{version}.json").read_text())["bad"]
                return reply, bad

            sync.stub = stub  # type: ignore[attr-defined]
            yield sync
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            if proc.poll() is None:
                proc.kill()
        stop.set()
        await asyncio.wait_for(task, 60)
