"""Shared memory (same host).

Fast path, cross-memory attach: the sender describes where its regions live and the receiver copies them
with `process_vm_readv` straight into its live tensors (one copy, no staging). Fallback, when the kernel
refuses: a two-slot ring in /dev/shm, one bucket per slot; the sender copies a bucket from parameter memory
into a free slot, the receiver copies it into views of its live tensors and acknowledges. Peak extra memory:
two buckets per link.
"""

from __future__ import annotations

import mmap
import os
import socket
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from services.weight_exchange.client.transports import cma
from services.weight_exchange.client.transports.base import Link, staged
from services.weight_exchange.client.wire import TransportError, recv_frame, send_frame, set_deadline

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
USE_CMA = os.environ.get("MESHRL_WX_SHM_CMA", "1") != "0"


def _buckets(buckets: list[int]) -> Iterator[tuple[int, list[int]]]:
    """(bucket, item indices) in order; items of one bucket are consecutive."""
    current: list[int] = []
    for k, b in enumerate(buckets):
        if current and buckets[current[0]] != b:
            yield buckets[current[0]], current
            current = []
        current.append(k)
    if current:
        yield buckets[current[0]], current


def _aligned(n: int) -> int:
    return (n + 63) & ~63


def _slot_bytes(sizes: list[int], buckets: list[int]) -> int:
    return max((sum(_aligned(sizes[k]) for k in idx) for _, idx in _buckets(buckets)), default=0)


class ShmTransport:
    name = "shm"

    def serve(self, conn: socket.socket, request: dict[str, Any], views: list[torch.Tensor], server: Any) -> None:
        if request.get("cma") and all(v.device.type == "cpu" for v in views):
            send_frame(conn, {"ok": True, "mode": "cma", "pid": os.getpid(), "views": [cma.describe(v) for v in views]})
            if recv_frame(conn) == "done":
                return
        self._serve_ring(conn, request, views)

    def pull(self, conn: socket.socket, reply: dict[str, Any], link: Link) -> None:
        if reply.get("mode") == "cma":
            try:
                self._pull_cma(reply, link)
                send_frame(conn, "done")
                return
            except cma.CmaUnavailable:
                send_frame(conn, "ring")
                set_deadline(conn, link.deadline)
                reply = recv_frame(conn)
        self._pull_ring(conn, reply, link)

    @staticmethod
    def request_options() -> dict[str, Any]:
        return {"cma": USE_CMA}

    def _pull_cma(self, reply: dict[str, Any], link: Link) -> None:
        pid = int(reply["pid"])
        staging = None
        for k, (item, (ptr, shape, strides, itemsize)) in enumerate(zip(link.items, reply["views"], strict=True)):
            link.current = k
            assert item.dst is not None
            remote = cma.runs(ptr, shape, strides, itemsize)
            if str(item.dst.dtype).removeprefix("torch.") == item.dtype and item.dst.device.type == "cpu":
                cma.read(pid, remote, cma.runs(*cma.describe(item.dst)))
                continue
            if staging is None:
                staging = link.staging()
            cma.read(pid, remote, [(staging.data_ptr(), item.num_bytes)])
            item.dst.copy_(staged(staging, item))

    def _serve_ring(self, conn: socket.socket, request: dict[str, Any], views: list[torch.Tensor]) -> None:
        sizes = [v.numel() * v.element_size() for v in views]
        buckets = [int(item[3]) for item in request["items"]]
        slot = max(_slot_bytes(sizes, buckets), 1)
        path = os.path.join(SHM_DIR, f"meshrl-wx-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, 2 * slot)
            mm = mmap.mmap(fd, 2 * slot)
        finally:
            os.close(fd)
        try:
            ring = torch.frombuffer(mm, dtype=torch.uint8)
            send_frame(conn, {"ok": True, "mode": "ring", "path": path, "slot": slot})
            in_flight = 0
            for n, (_b, idx) in enumerate(_buckets(buckets)):
                if in_flight == 2:
                    if recv_frame(conn) != "ack":
                        raise TransportError("shm: bad acknowledgement")
                    in_flight -= 1
                at = (n % 2) * slot
                for k in idx:
                    v = views[k]
                    ring[at:at + sizes[k]].view(v.dtype).view(v.shape).copy_(v)
                    at += _aligned(sizes[k])
                send_frame(conn, n % 2)
                in_flight += 1
            while in_flight:
                recv_frame(conn)
                in_flight -= 1
            del ring
        finally:
            os.unlink(path)
            mm.close()

    def _pull_ring(self, conn: socket.socket, reply: dict[str, Any], link: Link) -> None:
        slot = int(reply["slot"])
        fd = os.open(reply["path"], os.O_RDWR)
        try:
            mm = mmap.mmap(fd, 2 * slot)
        finally:
            os.close(fd)
        try:
            ring = torch.frombuffer(mm, dtype=torch.uint8)
            for _b, idx in _buckets([it.bucket for it in link.items]):
                link.current = idx[0]
                set_deadline(conn, link.deadline)
                at = int(recv_frame(conn)) * slot
                for k in idx:
                    link.current = k
                    item = link.items[k]
                    assert item.dst is not None
                    item.dst.copy_(staged(ring[at:at + item.num_bytes], item))
                    at += _aligned(item.num_bytes)
                send_frame(conn, "ack")
            del ring
        finally:
            mm.close()


class ShmRingTransport(ShmTransport):
    """The /dev/shm ring only (no cross-memory attach), e.g. where ptrace-based reads are not allowed."""

    name = "shm-ring"

    @staticmethod
    def request_options() -> dict[str, Any]:
        return {"cma": False}
