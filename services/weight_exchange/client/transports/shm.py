"""Shared memory (same host): a two-slot ring in /dev/shm, one bucket per slot.

The sender copies a bucket's regions from parameter memory into a free slot and says so on the control
connection; the receiver copies the slot into views of its live tensors and acknowledges. Two slots let the
sender fill one while the receiver drains the other: peak extra memory is two buckets per link.
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

from services.weight_exchange.client.transports.base import Link, staged
from services.weight_exchange.client.wire import TransportError, recv_frame, send_frame, set_deadline

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


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
            send_frame(conn, {"ok": True, "path": path, "slot": slot})
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

    def pull(self, conn: socket.socket, reply: dict[str, Any], link: Link) -> None:
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
