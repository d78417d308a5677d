"""TCP: the sender streams the regions on the control connection, the receiver reads into the live tensors.
Device tensors go through the host: the sender sends a CPU copy, the receiver stages and copies in place.
The sender casts each region to the receiver's dtype first (`casts`): an fp32 trainer feeding a bf16 engine sends
half the bytes, what the receiver holds (the memory-reading transports, shm and cma, move the sender's bytes)."""

from __future__ import annotations

import socket
from typing import Any

import torch

from services.weight_exchange.client.transports.base import Link, direct, staged
from services.weight_exchange.client.wire import byte_view, host, recv_into, send_frame, set_deadline


class TcpTransport:
    name = "tcp"
    casts = True    # the sender sends each region in the receiver's dtype (source.ReceiverDtypeViews)

    def serve(self, conn: socket.socket, request: dict[str, Any], views: list[torch.Tensor], server: Any) -> None:
        send_frame(conn, {"ok": True})
        for v in views:
            conn.sendall(byte_view(host(v)))

    def pull(self, conn: socket.socket, reply: dict[str, Any], link: Link) -> None:
        staging = None
        for k, item in enumerate(link.items):
            link.current = k
            set_deadline(conn, link.deadline)
            assert item.dst is not None
            if direct(item) and item.dst.device.type == "cpu":
                recv_into(conn, byte_view(item.dst))
                continue
            if staging is None:
                staging = link.staging()
            recv_into(conn, byte_view(staging[:item.num_bytes]))
            item.dst.copy_(staged(staging, item))
