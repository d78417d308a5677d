"""UCX through `ucxx` (pip `ucxx-cu12`): the sender runs a UCX listener; the receiver opens an endpoint per pull,
names the pull, and receives every region in plan order straight into its live tensors (tagged messages).

ucxx is asyncio-based: each process runs one UCX event loop in a background thread and the blocking
transport calls submit coroutines to it. The PyPI UCX build has no RDMA (TCP / shared memory here;
InfiniBand / RoCE with a system UCX).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections.abc import Coroutine
from typing import Any

import numpy as np
import torch

from services.weight_exchange.client.transports.base import Item, Link, direct, staged
from services.weight_exchange.client.wire import TransferTimeout, TransportError, host, recv_frame, send_frame

ID_BYTES = 32


class _Loop:
    """One asyncio loop per process for ucxx, in a daemon thread."""

    _instance: _Loop | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        import ucxx  # noqa: F401  (fail early and clearly when ucxx is missing)

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="wx-ucx", daemon=True).start()

    @classmethod
    def get(cls) -> _Loop:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout=max(0.001, timeout))
        except TimeoutError as exc:
            future.cancel()
            raise TransferTimeout("ucx: timed out") from exc


def _array(t: torch.Tensor) -> Any:
    """What ucxx sends from / receives into: a CUDA tensor itself, a CPU tensor's bytes (never a device tensor's
    `.numpy()`: other devices go through a CPU staging tensor, see `_ucx_direct`)."""
    flat = t.reshape(-1).view(torch.uint8)
    if flat.is_cuda:
        return flat
    if flat.device.type != "cpu":
        raise TypeError(f"ucx: a {flat.device.type} tensor goes through a CPU staging tensor")
    return flat.numpy()   # a CPU uint8 view: numpy-able whatever the tensor's dtype (bf16 included)


def _ucx_direct(item: Item) -> bool:
    """ucxx can land the bytes in place: a contiguous same-dtype CPU or CUDA tensor."""
    assert item.dst is not None
    return direct(item) and item.dst.device.type in ("cpu", "cuda")


class _Pull:
    """One pull the sender's listener is waiting to serve: what to send, and the two moments the control thread
    and the UCX loop tell each other about."""

    def __init__(self, views: list[torch.Tensor], timeout: float) -> None:
        self.views = views
        self.timeout = timeout
        self.sent = threading.Event()              # set on the UCX loop, waited for by the control thread
        self.errors: list[BaseException] = []
        self.received = asyncio.Event()            # set (thread-safely) by the control thread, waited on the loop


class UcxTransport:
    name = "ucx"

    def setup_sender(self, server: Any, endpoint: str) -> str:
        import ucxx

        loop = _Loop.get()
        pending: dict[str, _Pull] = {}

        async def handle(ep: Any) -> None:
            ident = np.empty(ID_BYTES, dtype=np.uint8)
            await ep.recv(ident)
            entry = pending.get(ident.tobytes().decode())
            if entry is None:
                await ep.close()
                return
            try:
                for v in entry.views:
                    await ep.send(_array(v.contiguous() if v.device.type in ("cpu", "cuda") else host(v)))
                entry.sent.set()
                # A completed send means our buffer is free, not that the bytes arrived: the endpoint stays open
                # until the receiver says, on the TCP connection, that its last receive completed (a UCX
                # goodbye message would itself be the last one in flight when we close).
                await asyncio.wait_for(entry.received.wait(), entry.timeout)
            except BaseException as exc:  # noqa: BLE001 - handed to the control thread
                entry.errors.append(exc)
                entry.sent.set()
            finally:
                await ep.close()

        async def listen() -> Any:
            return ucxx.create_listener(handle)

        listener = loop.run(listen(), 30.0)
        server.extras["ucx"] = (listener, pending)
        return endpoint

    def close_sender(self, server: Any) -> None:
        entry = server.extras.pop("ucx", None)
        if entry is not None:
            entry[0].close()

    def serve(self, conn: socket.socket, request: dict[str, Any], views: list[torch.Tensor], server: Any) -> None:
        listener, pending = server.extras["ucx"]
        loop = _Loop.get().loop
        timeout = float(request.get("timeout", 60.0))
        ident = uuid.uuid4().hex
        entry = pending[ident] = _Pull(views, timeout)
        try:
            send_frame(conn, {"ok": True, "port": listener.port, "id": ident})
            if not entry.sent.wait(timeout):
                raise TransferTimeout("ucx: receiver did not take the bytes in time")
            if not entry.errors:
                conn.settimeout(timeout)
                got = recv_frame(conn)   # the receiver's word that its last receive completed
                if not isinstance(got, dict) or not got.get("received"):
                    raise TransportError(f"ucx: the receiver did not confirm receipt: {got!r}")
        finally:
            loop.call_soon_threadsafe(entry.received.set)   # lets the handler close the endpoint in every case
            pending.pop(ident, None)
        if entry.errors:
            raise TransportError(f"ucx: {entry.errors[0]}")

    def pull(self, conn: socket.socket, reply: dict[str, Any], link: Link) -> None:
        import ucxx

        host = conn.getpeername()[0]

        async def receive() -> None:
            ep = await ucxx.create_endpoint(host, int(reply["port"]))
            try:
                await ep.send(np.frombuffer(reply["id"].encode(), dtype=np.uint8).copy())
                staging = None
                for k, item in enumerate(link.items):
                    link.current = k
                    assert item.dst is not None
                    if _ucx_direct(item):
                        await ep.recv(_array(item.dst))
                        continue
                    if staging is None:
                        staging = link.staging()
                    await ep.recv(_array(staging[:item.num_bytes]))
                    item.dst.copy_(staged(staging, item))
                link.current = -1
            finally:
                await ep.close()

        _Loop.get().run(receive(), link.deadline - time.monotonic())
        send_frame(conn, {"received": True})   # only now may the sender close its endpoint
