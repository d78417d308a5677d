"""The sender's data server: a control listener (thread per connection) that serves pull requests.

A pull request names regions of the sender's local tensors in plan order; the sender checks them all,
then hands the connection to the requested transport, which reads straight from parameter memory.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Mapping
from typing import Any

import torch

from services.common.logging import get_logger
from services.weight_exchange.client import transports
from services.weight_exchange.client.regions import Region
from services.weight_exchange.client.wire import TransportError, crc, recv_frame, region_view, send_frame

log = get_logger()


class SenderServer:
    """Serves this rank's tensors to receivers over every transport it offers."""

    def __init__(self, rank_id: str, tensors: Mapping[str, torch.Tensor], host: str = "127.0.0.1",
                 transport_names: tuple[str, ...] = ("tcp",)) -> None:
        self.rank_id = rank_id
        self.tensors = {k: v.detach() for k, v in tensors.items()}
        self.host = host
        self.transport_names = tuple(transport_names)
        self.extras: dict[str, Any] = {}     # per-transport state (e.g. the gloo store)
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def start(self) -> dict[str, str]:
        """Listen; returns the endpoints to register (transport name -> address)."""
        for name in self.transport_names:
            transports.get(name)
        sock = socket.create_server((self.host, 0), backlog=128)
        self._listener = sock
        port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name=f"wx-sender-{self.rank_id}", daemon=True)
        self._thread.start()
        endpoints = {name: f"{self.host}:{port}" for name in self.transport_names}
        for name in self.transport_names:
            setup = getattr(transports.get(name), "setup_sender", None)
            if setup is not None:
                endpoints[name] = setup(self, endpoints[name])
        return endpoints

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for name in self.transport_names:
            close = getattr(transports.get(name), "close_sender", None)
            if close is not None:
                close(self)

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        receiver = "?"
        with conn:
            try:
                conn.settimeout(30.0)
                request = recv_frame(conn)
                receiver = str(request.get("receiver", "?"))
                conn.settimeout(float(request.get("timeout", 60.0)))
                try:
                    views = self.resolve(request["items"])
                    if request["transport"] not in self.transport_names:
                        raise ValueError(f"transport: {request['transport']!r} is not offered by {self.rank_id} "
                                         f"(offers {', '.join(self.transport_names)})")
                except (ValueError, KeyError) as exc:
                    send_frame(conn, {"error": f"sender {self.rank_id}: {exc}"})
                    return
                transports.get(request["transport"]).serve(conn, request, views, self)
                if request.get("verify"):
                    send_frame(conn, {"crc": [crc(v) for v in views]})
            except (OSError, TransportError) as exc:
                log.warning("pull_failed", rank_id=self.rank_id, receiver=receiver, error=str(exc))
            except Exception:
                log.exception("pull_crashed", rank_id=self.rank_id)

    def resolve(self, items: list[list[Any]]) -> list[torch.Tensor]:
        """Views of the requested regions; ValueError naming the tensor when one does not exist here."""
        views = []
        for name, offsets, sizes, _bucket in items:
            t = self.tensors.get(name)
            if t is None:
                raise ValueError(f"has no tensor {name!r}")
            region = Region.of(offsets, sizes)
            if not region.within(t.shape):
                raise ValueError(f"region {region} is outside {name} of shape {list(t.shape)}")
            views.append(region_view(t, region))
        return views
