"""The receiver's side of an update: resolve views of the live tensors, pull every link in parallel."""

from __future__ import annotations

import dataclasses
import socket
import time
import zlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from services.common.errors import FieldError
from services.weight_exchange.client import delta, transports
from services.weight_exchange.client.layout import ITEMSIZE
from services.weight_exchange.client.regions import Region
from services.weight_exchange.client.transports.base import Item, Link, direct
from services.weight_exchange.client.wire import (
    TransferTimeout,
    TransportError,
    crc,
    recv_frame,
    region_view,
    send_frame,
    set_deadline,
)


class TransferLike(Protocol):
    src: str
    dst: str
    canonical_name: str
    src_local: str
    src_region: Region
    dst_local: str
    dst_region: Region
    num_bytes: int
    bucket: int
    dtype: str


@dataclasses.dataclass
class PullJob:
    """One update's data-plane work for a receiver, as the coordinator's ApplyRequest gives it: what a receiver
    whose bytes land in another process (an engine's own workers) hands over to be pulled there."""

    rank_id: str
    transfers: list[Any]            # Transfer (transfer.py)
    endpoints: dict[str, str]       # sender rank -> endpoint of `transport`
    transport: str
    timeout: float                  # seconds for the whole pull
    verify: bool
    version: int
    tickets: dict[str, str]         # sender rank -> the coordinator's ticket
    sync_id: str
    delta_base: int | None = None   # the version the receiver holds: only what changed since is sent
    track: bool = False             # the senders keep what they serve (the next delta's base)

    def run(self, tensors: Mapping[str, torch.Tensor]) -> PullResult:
        """Pull into `tensors` here (pull_all)."""
        return pull_all(self.rank_id, tensors, self.transfers, self.endpoints, self.transport, self.timeout,
                        verify=self.verify, version=self.version, tickets=self.tickets, sync_id=self.sync_id,
                        delta_base=self.delta_base, track=self.track)

    def to_json(self) -> dict[str, Any]:
        return {"rank_id": self.rank_id, "transfers": [t.to_row() for t in self.transfers],
                "endpoints": self.endpoints, "transport": self.transport, "timeout": self.timeout,
                "verify": self.verify, "version": self.version, "tickets": self.tickets, "sync_id": self.sync_id,
                "delta_base": self.delta_base, "track": self.track}

    @classmethod
    def from_json(cls, job: Mapping[str, Any]) -> PullJob:
        from services.weight_exchange.client.transfer import Transfer

        base = job.get("delta_base")
        return cls(job["rank_id"], [Transfer.from_row(r) for r in job["transfers"]], dict(job["endpoints"]),
                   job["transport"], float(job["timeout"]), bool(job["verify"]), int(job["version"]),
                   dict(job["tickets"]), job["sync_id"], None if base is None else int(base),
                   bool(job.get("track", False)))


@dataclasses.dataclass
class PullResult:
    bytes_received: int
    seconds: float
    checksum: str = ""
    bytes_full: int = 0     # the receiver's bytes of this update in its dtypes (what a full update moves at least)


def build_links(rank_id: str, tensors: Mapping[str, torch.Tensor], transfers: Sequence[TransferLike],
                deadline: float, verify: bool, cast: bool = False) -> dict[str, tuple[Link, list[list[Any]]]]:
    """Group transfers by sender and resolve their destination views; ValueError naming the bad field. With
    `cast` (a transport whose sender casts), an item whose receiver dtype differs travels in the receiver's."""
    links: dict[str, tuple[Link, list[list[Any]]]] = {}
    requests: dict[str, list[list[Any]]] = defaultdict(list)
    for i, t in enumerate(transfers):
        where = f"transfers[{i}]"
        dst = tensors.get(t.dst_local)
        if dst is None:
            raise FieldError(f"{where}.dst_local_name", f"{rank_id} has no tensor {t.dst_local!r}")
        if not t.dst_region.within(dst.shape):
            raise FieldError(f"{where}.dst_region", f"{t.dst_region} is outside {t.dst_local} {list(dst.shape)}")
        if t.dtype not in ITEMSIZE:
            raise FieldError(f"{where}.dtype", f"unknown {t.dtype!r}")
        if t.dst_region.numel != t.src_region.numel or t.num_bytes != t.dst_region.numel * ITEMSIZE[t.dtype]:
            raise FieldError(f"{where}.num_bytes", f"{t.num_bytes} does not match regions {t.src_region} -> "
                             f"{t.dst_region} of {t.dtype}")
        if t.src not in links:
            links[t.src] = (Link(t.src, rank_id, [], deadline, verify), requests[t.src])
        held = str(dst.dtype).removeprefix("torch.")
        wire, num_bytes = t.dtype, t.num_bytes
        if cast and held != t.dtype and held in ITEMSIZE:
            wire, num_bytes = held, t.dst_region.numel * ITEMSIZE[held]
        links[t.src][0].items.append(Item(t.canonical_name, t.bucket, num_bytes, wire, region_view(dst, t.dst_region)))
        # the receiver's dtype last: a sender keeping deltas compares what this receiver holds, one that casts
        # (cast_to_receiver in the pull's header) sends the region in it
        requests[t.src].append([t.src_local, list(t.src_region.offsets), list(t.src_region.sizes), t.bucket, held])
    return links


def pull_all(rank_id: str, tensors: Mapping[str, torch.Tensor], transfers: Sequence[TransferLike],
             endpoints: Mapping[str, str], transport: str, timeout: float, *, verify: bool = False,
             version: int = 0, tickets: Mapping[str, str] | None = None, sync_id: str = "",
             delta_base: int | None = None, track: bool = False) -> PullResult:
    """Pull every transfer into the live tensors (one thread per sender); TransportError names ranks and tensor.
    `tickets` (sender -> ticket) and `sync_id` come from the coordinator's ApplyRequest. `delta_base`: the version
    the tensors hold; only what changed since is sent (delta.py). `track`: the senders keep what they serve as
    the base of the next delta."""
    start = time.monotonic()
    deadline = start + timeout
    impl = transports.get(transport)
    cast = bool(getattr(impl, "casts", False))
    links = build_links(rank_id, tensors, transfers, deadline, verify, cast)
    for src in links:
        if src not in endpoints:
            raise FieldError("sender_endpoints", f"no {transport} endpoint for sender {src}")
    crcs: dict[str, list[int]] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(len(links), 16))) as pool:
        auth = {src: {"ticket": (tickets or {}).get(src, ""), "sync_id": sync_id, "delta_base": delta_base,
                      "track": track, "cast_to_receiver": cast} for src in links}
        futures = {src: pool.submit(_pull_link, impl, endpoints[src], link, items, version, crcs, auth[src])
                   for src, (link, items) in sorted(links.items())}
        errors = []
        for fut in futures.values():
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - every link's failure is reported
                errors.append(exc)
    if errors:
        timeout_hit = any(isinstance(e, TransferTimeout) for e in errors)
        message = "; ".join(str(e) for e in errors)
        raise (TransferTimeout if timeout_hit else TransportError)(message)
    total = sum(link.received if link.received >= 0 else sum(it.num_bytes for it in link.items)
                for link, _ in links.values())
    full = sum(it.dst.numel() * it.dst.element_size() for link, _ in links.values() for it in link.items
               if it.dst is not None)
    checksum = ""
    if verify:
        joined = ",".join(f"{src}:{c}" for src in sorted(crcs) for c in crcs[src])
        checksum = f"{zlib.crc32(joined.encode()):08x}"
    return PullResult(total, time.monotonic() - start, checksum, full)


@torch.no_grad()  # grad mode is per thread: each pulling thread writes live parameters outside autograd itself
def _pull_link(impl: transports.Transport, endpoint: str, link: Link, items: list[list[Any]], version: int,
               crcs: dict[str, list[int]], auth: dict[str, str] | None = None) -> None:
    try:
        host, port = endpoint.rsplit(":", 1)
        left = link.deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout("deadline passed before connecting")
        with socket.create_connection((host, int(port)), timeout=left) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            options = getattr(impl, "request_options", dict)()
            # The small header (with the ticket) first; the items only once the sender has checked the ticket.
            send_frame(conn, {"op": "pull", "transport": impl.name, "receiver": link.dst, "version": version,
                              "verify": link.verify, "timeout": max(1.0, left), **options, **(auth or {})})
            ready = recv_frame(conn)
            if "error" in ready:
                raise TransportError(ready["error"])
            send_frame(conn, {"items": items})
            reply = recv_frame(conn)
            if "error" in reply:
                raise TransportError(reply["error"])
            if reply.get("delta"):
                link.received = delta.pull(conn, link)
            else:
                impl.pull(conn, reply, link)
            link.current = -1
            set_deadline(conn, link.deadline)
            end = recv_frame(conn)      # the sender's word that the read was clean (not torn by an update)
            if "error" in end:
                raise TransportError(end["error"])
            if link.verify:
                crcs[link.src] = _verify(link, end["crc"])
    except TransportError as exc:
        raise type(exc)(f"{impl.name} {link.src} -> {link.dst}: {link.describe()}: {exc}") from exc
    except TimeoutError as exc:
        raise TransferTimeout(f"{impl.name} {link.src} -> {link.dst}: {link.describe()}: timed out") from exc
    except Exception as exc:  # noqa: BLE001 - any library's failure (OSError, gloo, ucxx) names link and tensor
        raise TransportError(f"{impl.name} {link.src} -> {link.dst}: {link.describe()}: "
                             f"{type(exc).__name__}: {exc}") from exc


def _verify(link: Link, sent: list[int]) -> list[int]:
    """Re-read what landed in the live tensors and compare with the sender's checksums."""
    got = []
    for k, (item, expected) in enumerate(zip(link.items, sent, strict=True)):
        assert item.dst is not None
        if not direct(item) and str(item.dst.dtype).removeprefix("torch.") != item.dtype:
            got.append(expected)   # cast on receipt: the bytes differ by design; the transport was checked
            continue
        value = crc(item.dst)
        if value != expected:
            link.current = k
            raise TransportError(f"checksum mismatch (sent {expected:08x}, landed {value:08x})")
        got.append(value)
    return got
