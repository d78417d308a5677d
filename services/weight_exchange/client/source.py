"""The sender's data server: a control listener (thread per connection) that serves pull requests.

A pull starts with a small header (receiver, version, ticket; at most MAX_HEADER bytes), answered with "ready"
once the ticket checks out; only then does the sender take the items, which name regions of its local tensors
in plan order. The sender checks them all, then hands the connection to the requested transport, which reads
straight from parameter memory, and ends with a frame saying whether the read was clean. Reads are never torn: the
trainer brackets every step that mutates the parameters with `begin_update` / `end_update(version)`
(a sequence lock), and a read is refused while an update runs, when it asks for another version, and
(in the end frame) when an update started while it was being served. With a `key` (every SenderAgent has one),
a pull is served only with the ticket the coordinator issued for this receiver, version and update (tickets.py).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from services.common.errors import FieldError
from services.common.logging import get_logger
from services.weight_exchange.client import delta, tickets, transports
from services.weight_exchange.client.delta import DeltaStore
from services.weight_exchange.client.layout import ITEMSIZE
from services.weight_exchange.client.regions import Region
from services.weight_exchange.client.wire import (
    MAX_HEADER,
    TransportError,
    crc,
    recv_frame,
    region_view,
    send_frame,
)

log = get_logger()


class SenderServer:
    """Serves this rank's tensors to receivers over every transport it offers."""

    def __init__(self, rank_id: str, tensors: Mapping[str, torch.Tensor], host: str = "127.0.0.1",
                 transport_names: tuple[str, ...] = ("tcp",), *, key: bytes | None = None,
                 max_connections: int = 256, max_unverified: int = 32, handshake_timeout: float = 10.0) -> None:
        if max_connections < 1 or max_unverified < 1:
            raise ValueError(f"max_connections, max_unverified: must be >= 1, got {max_connections}, {max_unverified}")
        if handshake_timeout <= 0:
            raise FieldError("handshake_timeout", f"must be > 0, got {handshake_timeout}")
        self.rank_id = rank_id
        self.key = key                       # None: any pull is served (a bare data server, e.g. in benchmarks)
        self.tensors = {k: v.detach() for k, v in tensors.items()}
        self.host = host
        self.transport_names = tuple(transport_names)
        self.extras: dict[str, Any] = {}     # per-transport state (e.g. the gloo store)
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._state = threading.Lock()
        self._seq = 0                        # odd while an update runs
        self.version: int | None = None      # of the parameters; None: not tracked (any version is served)
        # Each connection costs a thread. Those not past the ticket yet (a few KiB each, for at most
        # handshake_timeout) have a small cap of their own, so peers without a ticket cannot take every slot
        # for long; the overall cap bounds the threads a ticket holder can make the sender run.
        self.max_connections = max_connections
        self.max_unverified = max_unverified
        self.handshake_timeout = handshake_timeout
        self._open = 0                       # connections being served (guarded by _state)
        self._unverified = 0                 # of which not past the ticket check yet
        self._over_cap = 0                   # connections closed at once for the caps (the accept thread's)
        self.deltas = DeltaStore()           # what it served, when the coordinator tracks deltas (delta.py)

    def begin_update(self) -> None:
        """The parameters are about to change (thread-safe): reads are refused until `end_update`."""
        with self._state:
            if self._seq % 2 == 0:
                self._seq += 1

    def end_update(self, version: int) -> None:
        """The parameters now hold `version` (thread-safe)."""
        if version < 0:
            raise FieldError("version", f"must be >= 0, got {version}")
        with self._state:
            self._seq += 1 if self._seq % 2 else 2
            self.version = version

    def begin_read(self, version: int) -> int:
        """The sequence number to check after the read; ValueError when the parameters cannot be read now."""
        with self._state:
            if self._seq % 2:
                raise ValueError(f"parameters are being updated (from version {self.version}); retry")
            if self.version is not None and version != self.version:
                raise FieldError("version", f"holds {self.version}, not the requested {version}")
            return self._seq

    def end_read(self, seq: int, version: int) -> str:
        """An error message when an update started since `begin_read` (the read may be torn), else ""."""
        with self._state:
            if self._seq != seq:
                return f"parameters changed while version {version} was read (torn read); retry"
        return ""

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
                conn, peer = self._listener.accept()
            except OSError:
                return
            if not self._admit():
                # Over the cap: closed at once, before a thread or a byte of it is taken (the receiver sees the
                # connection closed and its sync fails, to be retried by the trainer).
                self._over_cap += 1
                if self._over_cap % 1000 == 1:      # once per burst, not once per connection of a flood
                    log.warning("pull_refused", rank_id=self.rank_id, peer=str(peer[0]), refused=self._over_cap,
                                reason="too many connections")
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _admit(self) -> bool:
        """Take a connection slot and an unverified slot; False (nothing taken) when either cap is reached."""
        with self._state:
            if self._open >= self.max_connections or self._unverified >= self.max_unverified:
                return False
            self._open += 1
            self._unverified += 1
            return True

    def _release(self, verified: bool) -> None:
        with self._state:
            self._open -= 1
            if not verified:
                self._unverified -= 1

    def _verified(self) -> None:
        with self._state:
            self._unverified -= 1

    def _serve(self, conn: socket.socket) -> None:
        receiver, verified = "?", False
        with conn:
            try:
                conn.settimeout(self.handshake_timeout)
                header = recv_frame(conn, MAX_HEADER)
                if not isinstance(header, dict):
                    raise TransportError("pull header: not a map")
                receiver = str(header.get("receiver", "?"))
                if not self._ticket_ok(conn, header, receiver):
                    return
                self._verified()
                verified = True
                self._pull(conn, header)
            except (OSError, TransportError, ValueError) as exc:   # ValueError: a frame that is not msgpack
                log.warning("pull_failed", rank_id=self.rank_id, receiver=receiver, error=str(exc))
            except Exception:
                log.exception("pull_crashed", rank_id=self.rank_id)
            finally:
                self._release(verified)

    def _ticket_ok(self, conn: socket.socket, header: dict[str, Any], receiver: str) -> bool:
        """Whether the header presents a valid ticket (always, without a key); sends the refusal when not."""
        version = int(header.get("version", 0))
        if self.key is None or tickets.ticket_ok(self.key, header.get("ticket"), receiver, version,
                                                 header.get("sync_id")):
            return True
        log.warning("pull_refused", rank_id=self.rank_id, receiver=receiver, version=version,
                    reason="no valid ticket")
        send_frame(conn, {"error": f"sender {self.rank_id}: pull refused: no valid ticket from the "
                                   f"coordinator for {receiver} at version {version}"})
        return False

    def _pull(self, conn: socket.socket, header: dict[str, Any]) -> None:
        """After the ticket: take the items (the one large frame), check them and serve them."""
        send_frame(conn, {"ready": True})
        conn.settimeout(float(header.get("timeout", 60.0)))
        body = recv_frame(conn)
        request = {**header, "items": body.get("items") if isinstance(body, dict) else None}
        version = int(request.get("version", 0))
        try:
            if not isinstance(request["items"], list):
                raise FieldError("items", "missing or not a list")
            views = self.resolve(request["items"])
            if request["transport"] not in self.transport_names:
                raise FieldError("transport", f"{request['transport']!r} is not offered by {self.rank_id} "
                                 f"(offers {', '.join(self.transport_names)})")
            base, track = request.get("delta_base"), bool(request.get("track"))
            keys = delta.keys_of(request["items"]) if base is not None or track else []
            seq = self.begin_read(version)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            send_frame(conn, {"error": f"sender {self.rank_id}: {exc}"})
            return
        impl = transports.get(request["transport"])
        # what a casting transport sends, and what is checksummed, is the receiver's dtype; deltas and the bases
        # kept for them cast the plain views themselves (delta.as_dtype), once
        wire = (ReceiverDtypeViews(views, request["items"])
                if request.get("cast_to_receiver") and getattr(impl, "casts", False) else views)
        served: dict[delta.Key, torch.Tensor] | None
        if base is not None:
            served = delta.serve(conn, views, keys, int(base), self.deltas, self.rank_id)
            if served is None:
                return      # refused: the receiver needs a full update
        else:
            impl.serve(conn, request, wire, self)
            served = delta.snapshot(views, keys) if track else {}
        end: dict[str, Any] = {"crc": [crc(v) for v in wire]} if request.get("verify") else {}
        torn = self.end_read(seq, version)
        if not torn and served:
            self.deltas.keep(served, version)
        send_frame(conn, {"error": f"sender {self.rank_id}: {torn}"} if torn else {"done": True, **end})

    def resolve(self, items: list[list[Any]]) -> list[torch.Tensor]:
        """Views of the requested regions; ValueError naming the tensor when one does not exist here."""
        views = []
        for name, offsets, sizes, *_rest in items:    # [name, offsets, sizes, bucket(, receiver dtype)]
            t = self.tensors.get(name)
            if t is None:
                raise ValueError(f"has no tensor {name!r}")
            region = Region.of(offsets, sizes)
            if not region.within(t.shape):
                raise ValueError(f"region {region} is outside {name} of shape {list(t.shape)}")
            views.append(region_view(t, region))
        return views


class ReceiverDtypeViews(Sequence[torch.Tensor]):
    """`views`, each cast to its receiver's dtype (the items' last field) when it differs, one at a time as it is
    read: a transport that copies then moves the receiver's bytes, and at most one cast region is held at once."""

    def __init__(self, views: list[torch.Tensor], items: list[list[Any]]) -> None:
        self.views = views
        self.dtypes = [str(it[4]) if len(it) > 4 else "" for it in items]

    def __len__(self) -> int:
        return len(self.views)

    def __getitem__(self, i):  # type: ignore[override] - an index, never a slice
        view, dtype = self.views[i], self.dtypes[i]
        if not dtype or str(view.dtype).removeprefix("torch.") == dtype or dtype not in ITEMSIZE:
            return view
        return delta.as_dtype(view, dtype)
