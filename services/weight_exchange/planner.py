"""The transfer planner: from sender and receiver layouts, which bytes move from which sender to which receiver.

Deterministic (same layouts -> same plan and hash on every rank). Every receiver byte is planned exactly once:
each receiver shard is cut along the boundaries of the sender shards that overlap it, and each cell goes to
one sender holding it: same host first, then a sender the receiver already pulls from (few links), then the
one with the fewest bytes assigned so far (data-parallel replicas share the load). Transfers are split to at most one bucket and coalesced per link into buckets.

A receiver whose layout is post-load transformed (`RankLayout.post_load_transformed`: the engine keeps its weights
in a private rearranged format) never gets raw bytes written into its live tensors: its transfers land in staging
tensors named by canonical name (whole checkpoint tensors), `Plan.load_weights` lists it, and it must hand them to
the engine's own `load_weights`. Pure but for a warning log.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections import defaultdict
from collections.abc import Sequence

from services.common.errors import FieldError
from services.weight_exchange.client.layout import ITEMSIZE, RECEIVER, SENDER, RankLayout, Shard
from services.weight_exchange.client.regions import Region, grid, split
from services.weight_exchange.client.transfer import DEFAULT_BUCKET_BYTES, Transfer

log = logging.getLogger(__name__)


class PlanError(ValueError):
    """The layouts cannot be matched (a receiver needs bytes no sender holds, shapes disagree, ...)."""


@dataclasses.dataclass
class PlanStats:
    total_bytes: int = 0
    max_bytes_per_link: int = 0
    max_bytes_per_rank: int = 0
    num_messages: int = 0
    num_buckets: int = 0
    num_links: int = 0
    bytes_per_sender: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes_per_receiver: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Plan:
    transfers: list[Transfer]
    stats: PlanStats
    plan_hash: str
    senders: list[str]
    receivers: list[str]
    # receivers that must apply through the engine's `load_weights` (post-load-transformed layouts): their
    # transfers' dst_local names are canonical names of staging tensors, never live tensors
    load_weights: list[str] = dataclasses.field(default_factory=list)

    def for_receiver(self, rank_id: str) -> list[Transfer]:
        return [t for t in self.transfers if t.dst == rank_id]


def plan(senders: Sequence[RankLayout], receivers: Sequence[RankLayout], *,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES, stats_only: bool = False) -> Plan:
    """Plan one update; raises PlanError naming the ranks and the tensor when the layouts do not match.

    `stats_only` (paper-scale simulation) keeps the sender choices and statistics but builds no transfers.
    """
    if bucket_bytes <= 0:
        raise FieldError("bucket_bytes", f"must be positive, got {bucket_bytes}")
    senders = sorted(senders, key=lambda layout: layout.rank_id)
    receivers = sorted((_receiving(r) for r in receivers), key=lambda layout: layout.rank_id)
    assert all(s.role == SENDER for s in senders) and all(r.role == RECEIVER for r in receivers)
    staged = [r.rank_id for r in receivers if r.post_load_transformed]
    index = _index_senders(senders)
    load = [0] * len(senders)
    geometry: dict[int, tuple[Shard, int, list[tuple[Region, list[tuple[int, Shard]]]]]] = {}
    raw: list[Transfer] = []
    acc = _Accumulator(bucket_bytes)
    order: dict[int, list[Shard]] = {}
    for j, receiver in enumerate(receivers):
        linked: set[int] = set()
        shards = order.get(id(receiver.shards))
        if shards is None:
            shards = order[id(receiver.shards)] = sorted(
                receiver.shards, key=lambda s: (s.canonical_name, s.canonical_region, s.local_name))
        for shard in shards:
            key = id(shard)
            if key not in geometry:
                geometry[key] = (shard, *_geometry(receiver, shard, index, senders))
            _, itemsize, cells = geometry[key]
            chosen = _choose(receiver, j, cells, itemsize, senders, load, linked)
            if stats_only:
                for cell, i, _src in chosen:
                    acc.add(senders[i].rank_id, receiver.rank_id, cell.numel * itemsize)
                continue
            for cell, i, src in chosen:
                raw.append(Transfer(senders[i].rank_id, receiver.rank_id, shard.canonical_name, src.local_name,
                                    src.to_local(cell), shard.local_name, shard.to_local(cell),
                                    cell.numel * itemsize, dtype=src.dtype))
    names = ([s.rank_id for s in senders], [r.rank_id for r in receivers])
    if stats_only:
        return Plan([], acc.stats(), acc.digest(), *names, load_weights=staged)
    transfers = _bucketize(raw, bucket_bytes)
    return Plan(transfers, _stats(transfers), plan_hash(transfers), *names, load_weights=staged)


def _receiving(layout: RankLayout) -> RankLayout:
    """The layout the planner writes into: a post-load-transformed receiver's is its staging layout."""
    if not layout.post_load_transformed:
        return layout
    log.warning("weight_exchange: receiver %s declares a post-load-transformed layout (%s): no raw bytes are "
                "written into its live tensors; it receives whole checkpoint tensors for the engine's load_weights",
                layout.rank_id, layout.framework)
    return dataclasses.replace(layout, shards=layout.staging_shards())


def _index_senders(senders: Sequence[RankLayout]) -> dict[str, list[tuple[Region, list[tuple[int, Shard]]]]]:
    """canonical name -> distinct sender regions, each with every (sender index, shard) holding it."""
    index: dict[str, dict[Region, list[tuple[int, Shard]]]] = defaultdict(dict)
    first: dict[str, tuple[int, Shard]] = {}
    for i, layout in enumerate(senders):
        for shard in layout.shards:
            name = shard.canonical_name
            if name in first:
                fi, fs = first[name]
                if fs.canonical_shape != shard.canonical_shape or fs.dtype != shard.dtype:
                    raise PlanError(f"{name}: sender {layout.rank_id} has shape {list(shard.canonical_shape)} "
                                    f"{shard.dtype}, sender {senders[fi].rank_id} has {list(fs.canonical_shape)} "
                                    f"{fs.dtype}")
            else:
                first[name] = (i, shard)
            index[name].setdefault(shard.canonical_region, []).append((i, shard))
    return {name: list(groups.items()) for name, groups in index.items()}


def _geometry(receiver: RankLayout, shard: Shard, index: dict[str, list[tuple[Region, list[tuple[int, Shard]]]]],
              senders: Sequence[RankLayout]) -> tuple[int, list[tuple[Region, list[tuple[int, Shard]]]]]:
    """The cells of a receiver shard and, for each, every sender shard holding it (same for DP replicas)."""
    name = shard.canonical_name
    groups = index.get(name)
    if not groups:
        raise PlanError(f"{name}: receiver {receiver.rank_id} needs it and no sender holds it")
    some = groups[0][1][0]
    if some[1].canonical_shape != shard.canonical_shape:
        raise PlanError(f"{name}: receiver {receiver.rank_id} has shape {list(shard.canonical_shape)}, sender "
                        f"{senders[some[0]].rank_id} has {list(some[1].canonical_shape)}")
    box = shard.canonical_region
    containing = [holders for region, holders in groups if region.contains(box)]
    if containing:
        return some[1].itemsize, [(box, [h for hs in containing for h in hs])]
    cands = [(region, holders) for region, holders in groups if region.intersect(box) is not None]
    cells = []
    for cell in grid(box, [region for region, _ in cands]):
        if cell.numel == 0:
            continue
        holders = [h for region, hs in cands if region.contains(cell) for h in hs]
        if not holders:
            raise PlanError(f"{name}: receiver {receiver.rank_id} needs region {cell} and no sender holds it")
        cells.append((cell, holders))
    return some[1].itemsize, cells


def _choose(receiver: RankLayout, j: int, cells: list[tuple[Region, list[tuple[int, Shard]]]], itemsize: int,
            senders: Sequence[RankLayout], load: list[int], linked: set[int]) -> list[tuple[Region, int, Shard]]:
    n = len(senders)
    chosen: list[tuple[Region, int, Shard]] = []
    for cell, holders in cells:
        if len(holders) == 1:
            i, src = holders[0]
        else:
            near = [h for h in holders if receiver.host and senders[h[0]].host == receiver.host] or holders
            # a sender this receiver already pulls from, then the least loaded one (DP replicas share the load)
            i, src = min(near, key=lambda h: (h[0] not in linked, load[h[0]], (h[0] - j) % n))
        linked.add(i)
        load[i] += cell.numel * itemsize
        chosen.append((cell, i, src))
    return _merge(chosen) if len(chosen) > 1 else chosen


class _Accumulator:
    """Plan statistics without transfer objects (simulation)."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.links: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        self.hash = hashlib.sha256()

    def add(self, src: str, dst: str, num_bytes: int) -> None:
        link = self.links[(src, dst)]
        link[0] += num_bytes
        link[1] += -(-num_bytes // self.bucket_bytes)

    def stats(self) -> PlanStats:
        sent: dict[str, int] = defaultdict(int)
        received: dict[str, int] = defaultdict(int)
        for (src, dst), (b, _) in self.links.items():
            sent[src] += b
            received[dst] += b
        return PlanStats(total_bytes=sum(b for b, _ in self.links.values()),
                         max_bytes_per_link=max((b for b, _ in self.links.values()), default=0),
                         max_bytes_per_rank=max([*sent.values(), *received.values()], default=0),
                         num_messages=sum(m for _, m in self.links.values()),
                         num_buckets=sum(-(-b // self.bucket_bytes) for b, _ in self.links.values()),
                         num_links=len(self.links), bytes_per_sender=dict(sent), bytes_per_receiver=dict(received))

    def digest(self) -> str:
        for (src, dst), (b, m) in sorted(self.links.items()):
            self.hash.update(f"{src}|{dst}|{b}|{m}\n".encode())
        return self.hash.hexdigest()[:16]


def _merge(chosen: list[tuple[Region, int, Shard]]) -> list[tuple[Region, int, Shard]]:
    """Join neighbouring cells taken from the same sender shard (cells are in row-major order)."""
    out: list[tuple[Region, int, Shard]] = []
    for cell, i, src in chosen:
        if out:
            prev, pi, psrc = out[-1]
            if pi == i and psrc is src and (joined := _join(prev, cell)) is not None:
                out[-1] = (joined, i, src)
                continue
        out.append((cell, i, src))
    return out


def _join(a: Region, b: Region) -> Region | None:
    diff = [d for d in range(a.ndim) if a.offsets[d] != b.offsets[d] or a.sizes[d] != b.sizes[d]]
    if len(diff) != 1:
        return None
    d = diff[0]
    if a.offsets[d] + a.sizes[d] != b.offsets[d]:
        return None
    sizes = list(a.sizes)
    sizes[d] += b.sizes[d]
    return Region(a.offsets, tuple(sizes))


def _bucketize(raw: list[Transfer], bucket_bytes: int) -> list[Transfer]:
    """Split transfers to at most one bucket each, then number buckets per link in plan order."""
    links: dict[tuple[str, str], list[Transfer]] = defaultdict(list)
    for t in raw:
        links[(t.src, t.dst)].append(t)
    out: list[Transfer] = []
    for (_src, _dst), items in sorted(links.items()):
        bucket, used = 0, 0
        for t in items:
            for piece in _split_transfer(t, bucket_bytes):
                if used and used + piece.num_bytes > bucket_bytes:
                    bucket, used = bucket + 1, 0
                used += piece.num_bytes
                out.append(dataclasses.replace(piece, bucket=bucket))
    return out


def _split_transfer(t: Transfer, bucket_bytes: int) -> list[Transfer]:
    if t.num_bytes <= bucket_bytes:
        return [t]
    itemsize = t.num_bytes // max(1, t.src_region.numel)
    lead_s = t.src_region.ndim - t.dst_region.ndim
    # cut the region in its common (trailing) dimensions; leading size-1 dims stay as they are
    core_src = Region(t.src_region.offsets[max(0, lead_s):], t.src_region.sizes[max(0, lead_s):])
    core_dst = Region(t.dst_region.offsets[max(0, -lead_s):], t.dst_region.sizes[max(0, -lead_s):])
    pieces = []
    for piece in split(Region((0,) * core_src.ndim, core_src.sizes), itemsize, bucket_bytes):
        src = Region(t.src_region.offsets[:max(0, lead_s)] + tuple(a + b for a, b in zip(core_src.offsets, piece.offsets, strict=True)),
                     t.src_region.sizes[:max(0, lead_s)] + piece.sizes)
        dst = Region(t.dst_region.offsets[:max(0, -lead_s)] + tuple(a + b for a, b in zip(core_dst.offsets, piece.offsets, strict=True)),
                     t.dst_region.sizes[:max(0, -lead_s)] + piece.sizes)
        pieces.append(dataclasses.replace(t, src_region=src, dst_region=dst, num_bytes=piece.numel * itemsize))
    return pieces


def _stats(transfers: list[Transfer]) -> PlanStats:
    per_link: dict[tuple[str, str], int] = defaultdict(int)
    sent: dict[str, int] = defaultdict(int)
    received: dict[str, int] = defaultdict(int)
    buckets = set()
    for t in transfers:
        per_link[(t.src, t.dst)] += t.num_bytes
        sent[t.src] += t.num_bytes
        received[t.dst] += t.num_bytes
        buckets.add((t.src, t.dst, t.bucket))
    return PlanStats(
        total_bytes=sum(per_link.values()), max_bytes_per_link=max(per_link.values(), default=0),
        max_bytes_per_rank=max([*sent.values(), *received.values()], default=0), num_messages=len(transfers),
        num_buckets=len(buckets), num_links=len(per_link), bytes_per_sender=dict(sent), bytes_per_receiver=dict(received))


def plan_hash(transfers: Sequence[Transfer]) -> str:
    h = hashlib.sha256()
    for t in transfers:
        h.update(f"{t.src}|{t.dst}|{t.canonical_name}|{t.src_local}|{t.src_region}|{t.dst_local}|"
                 f"{t.dst_region}|{t.num_bytes}|{t.bucket}\n".encode())
    return h.hexdigest()[:16]


def bytes_min(receivers: Sequence[RankLayout], wire_itemsize: dict[str, int] | None = None) -> int:
    """Bytes the receivers need (each receiver byte once), in the senders' dtype when given."""
    total = 0
    for r in receivers:
        for s in (r.staging_shards() if r.post_load_transformed else r.shards):
            total += s.canonical_region.numel * (wire_itemsize or {}).get(s.canonical_name, ITEMSIZE[s.dtype])
    return total
