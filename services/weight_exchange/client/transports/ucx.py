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
from services.weight_exchange.client.wire import TransferTimeout, TransportError, host, send_frame

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


class UcxTransport:
    name = "ucx"

    def setup_sender(self, server: Any, endpoint: str) -> str:
        import ucxx

        loop = _Loop.get()
        pending: dict[str, tuple[list[torch.Tensor], threading.Event, list[BaseException]]] = {}

        async def handle(ep: Any) -> None:
            ident = np.empty(ID_BYTES, dtype=np.uint8)
            await ep.recv(ident)
            entry = pending.get(ident.tobytes().decode())
            if entry is None:
                await ep.close()
                return
            views, done, errors = entry
            try:
                for v in views:
                    await ep.send(_array(v.contiguous() if v.device.type in ("cpu", "cuda") else host(v)))
                # the receiver acknowledges everything, then waits for our goodbye before it closes: no side
                # tears the endpoint down while a message is still in flight
                await ep.recv(np.empty(1, dtype=np.uint8))
                await ep.send(np.ones(1, dtype=np.uint8))
            except BaseException as exc:  # noqa: BLE001 - handed to the control thread
                errors.append(exc)
            finally:
                done.set()

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
        ident = uuid.uuid4().hex
        done, errors = threading.Event(), []
        pending[ident] = (views, done, errors)
        try:
            send_frame(conn, {"ok": True, "port": listener.port, "id": ident})
            if not done.wait(float(request.get("timeout", 60.0))):
                raise TransferTimeout("ucx: receiver did not finish in time")
            if errors:
                raise TransportError(f"ucx: {errors[0]}")
        finally:
            pending.pop(ident, None)

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
                await ep.send(np.ones(1, dtype=np.uint8))
                await ep.recv(np.empty(1, dtype=np.uint8))
            finally:
                await ep.close()

        _Loop.get().run(receive(), link.deadline - time.monotonic())
