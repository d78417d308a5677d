"""A rank's layout: which regions of which canonical (Hugging Face) tensors it holds, and where.

A `Shard` says: region `canonical_region` of canonical tensor `canonical_name` sits at `local_region`
of the rank's local tensor `local_name`. The local region has the canonical region's sizes, possibly
preceded by size-1 dimensions (an expert index in a fused `[E, rows, cols]` tensor). Pure, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from services.common.contracts import data_pb2
from services.common.errors import FieldError
from services.weight_exchange.client.regions import Region

ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
SENDER, RECEIVER = "sender", "receiver"
# `parallel[POST_LOAD_TRANSFORMED] = 1`: the receiver's engine rearranges its weights after loading in a private
# format (SGLang triton-kernels MoE, FlashInfer, AITER, CPU weight packing, Ascend private formats); raw bytes must
# never be written into those tensors. The planner then sends whole checkpoint tensors into staging buffers named by
# their canonical names, and the receiver feeds them to the engine's own `load_weights`.
POST_LOAD_TRANSFORMED = "post_load_transformed"
_ROLE_TO_PB = {SENDER: data_pb2.RANK_ROLE_SENDER, RECEIVER: data_pb2.RANK_ROLE_RECEIVER}
_PB_TO_ROLE = {v: k for k, v in _ROLE_TO_PB.items()}


@dataclasses.dataclass(frozen=True)
class Shard:
    canonical_name: str
    canonical_shape: tuple[int, ...]
    dtype: str
    canonical_region: Region
    local_name: str
    local_shape: tuple[int, ...]
    local_region: Region

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def num_bytes(self) -> int:
        return self.canonical_region.numel * self.itemsize

    def to_local(self, sub: Region) -> Region:
        """The local region holding `sub`, a part of this shard's canonical region."""
        assert self.canonical_region.contains(sub), (self.canonical_name, sub, self.canonical_region)
        lead = self.local_region.ndim - sub.ndim
        offs = self.local_region.offsets[:lead] + tuple(
            lo + (s - c) for lo, s, c in zip(self.local_region.offsets[lead:], sub.offsets,
                                             self.canonical_region.offsets, strict=True))
        return Region(offs, (1,) * lead + sub.sizes)

    def check(self, where: str) -> None:
        """Raise ValueError naming the field when this shard is inconsistent."""
        if not self.canonical_name:
            raise FieldError(f"{where}.canonical_name", "required")
        if not self.local_name:
            raise FieldError(f"{where}.local_name", "required")
        if self.dtype not in ITEMSIZE:
            raise FieldError(f"{where}.dtype", f"unknown {self.dtype!r} (known: {', '.join(ITEMSIZE)})")
        if not self.canonical_region.within(self.canonical_shape):
            raise FieldError(f"{where}.canonical_region", f"{self.canonical_region} is not inside "
                             f"canonical_shape {list(self.canonical_shape)} of {self.canonical_name}")
        if not self.local_region.within(self.local_shape):
            raise FieldError(f"{where}.local_region", f"{self.local_region} is not inside local_shape "
                             f"{list(self.local_shape)} of {self.local_name}")
        lead = self.local_region.ndim - self.canonical_region.ndim
        if lead < 0 or any(s != 1 for s in self.local_region.sizes[:lead]) \
                or self.local_region.sizes[lead:] != self.canonical_region.sizes:
            raise FieldError(f"{where}.local_region", f"sizes {list(self.local_region.sizes)} do not match "
                             f"canonical_region sizes {list(self.canonical_region.sizes)} of {self.canonical_name}")


def full_shard(name: str, shape: Sequence[int], dtype: str, local_name: str | None = None) -> Shard:
    shape = tuple(int(s) for s in shape)
    return Shard(name, shape, dtype, Region.full(shape), local_name or name, shape, Region.full(shape))


@dataclasses.dataclass
class RankLayout:
    rank_id: str
    role: str
    framework: str
    shards: list[Shard]
    parallel: dict[str, int] = dataclasses.field(default_factory=dict)
    agent_address: str = ""
    endpoints: dict[str, str] = dataclasses.field(default_factory=dict)
    host: str = ""
    version: int = 0    # sender: of the parameters it holds; receiver: applied (-1: not tracked)

    @property
    def num_bytes(self) -> int:
        return sum(s.num_bytes for s in self.shards)

    @property
    def post_load_transformed(self) -> bool:
        """Its live tensors are in a private post-load format: updates go through the engine's `load_weights`."""
        return bool(self.parallel.get(POST_LOAD_TRANSFORMED, 0))

    def staging_shards(self) -> list[Shard]:
        """What a post-load-transformed receiver receives: every checkpoint tensor it holds any part of, whole, in a
        staging tensor named by its canonical name (the input of the engine's `load_weights`)."""
        seen: dict[str, tuple[tuple[int, ...], str]] = {}
        for s in self.shards:
            seen.setdefault(s.canonical_name, (s.canonical_shape, s.dtype))
        return [full_shard(name, shape, dtype) for name, (shape, dtype) in sorted(seen.items())]

    def local_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """local name -> (shape, dtype)."""
        return {s.local_name: (s.local_shape, s.dtype) for s in self.shards}

    def same_except_version(self, other: RankLayout) -> bool:
        """Equal but for `version`: a re-registration that is only a heartbeat."""
        return dataclasses.replace(self, version=0) == dataclasses.replace(other, version=0)

    def validate(self, where: str = "layout") -> None:
        """Raise ValueError naming the field (e.g. `layout.shards[3].local_region`) on the first problem."""
        if not self.rank_id:
            raise FieldError(f"{where}.rank_id", "required")
        if self.role not in (SENDER, RECEIVER):
            raise FieldError(f"{where}.role", f"must be sender or receiver, got {self.role!r}")
        if not self.shards:
            raise FieldError(f"{where}.shards", "a rank must hold at least one tensor")
        if self.role == RECEIVER and not self.agent_address:
            raise FieldError(f"{where}.agent_address", "required for a receiver")
        if self.role == SENDER and not self.endpoints:
            raise FieldError(f"{where}.endpoints", "a sender needs at least one transport endpoint")
        if self.version < -1:
            raise FieldError(f"{where}.version", f"must be >= -1 (-1: not tracked), got {self.version}")
        locals_: dict[str, tuple[tuple[int, ...], str]] = {}
        canon: dict[str, tuple[tuple[int, ...], str]] = {}
        for i, shard in enumerate(self.shards):
            shard.check(f"{where}.shards[{i}]")
            seen = locals_.setdefault(shard.local_name, (shard.local_shape, shard.dtype))
            if seen != (shard.local_shape, shard.dtype):
                raise FieldError(f"{where}.shards[{i}].local_shape", f"{shard.local_name} is {seen} in an earlier "
                                 f"shard, {(shard.local_shape, shard.dtype)} here")
            got = canon.setdefault(shard.canonical_name, (shard.canonical_shape, shard.dtype))
            if got[0] != shard.canonical_shape:
                raise FieldError(f"{where}.shards[{i}].canonical_shape", f"{shard.canonical_name} is {list(got[0])} "
                                 f"in an earlier shard, {list(shard.canonical_shape)} here")
        if self.role == RECEIVER:
            _check_disjoint(self.shards, where)

    def to_proto(self) -> data_pb2.RankLayout:
        return data_pb2.RankLayout(
            rank_id=self.rank_id, role=_ROLE_TO_PB.get(self.role, data_pb2.RANK_ROLE_UNSPECIFIED),
            framework=self.framework, parallel=self.parallel, agent_address=self.agent_address,
            endpoints=self.endpoints, host=self.host, version=self.version,
            shards=[data_pb2.ShardSpec(
                canonical_name=s.canonical_name, canonical_shape=s.canonical_shape, dtype=s.dtype,
                canonical_region=region_to_proto(s.canonical_region), local_name=s.local_name,
                local_shape=s.local_shape, local_region=region_to_proto(s.local_region)) for s in self.shards])

    @classmethod
    def from_proto(cls, pb: data_pb2.RankLayout) -> RankLayout:
        return cls(rank_id=pb.rank_id, role=_PB_TO_ROLE.get(pb.role, ""), framework=pb.framework,
                   parallel=dict(pb.parallel), agent_address=pb.agent_address, endpoints=dict(pb.endpoints),
                   host=pb.host, version=pb.version, shards=[Shard(
                       s.canonical_name, tuple(s.canonical_shape), s.dtype, region_from_proto(s.canonical_region),
                       s.local_name, tuple(s.local_shape), region_from_proto(s.local_region)) for s in pb.shards])


def _check_disjoint(shards: Iterable[Shard], where: str) -> None:
    by_local: dict[str, list[tuple[int, Shard]]] = {}
    for i, s in enumerate(shards):
        by_local.setdefault(s.local_name, []).append((i, s))
    for items in by_local.values():
        if len(items) < 2:
            continue
        items.sort(key=lambda t: t[1].local_region.offsets)
        for a in range(len(items)):
            for b in range(a + 1, len(items)):
                ra, rb = items[a][1].local_region, items[b][1].local_region
                if ra.ndim and rb.offsets[0] >= ra.offsets[0] + ra.sizes[0]:
                    break
                if ra.intersect(rb) is not None:
                    raise FieldError(f"{where}.shards[{items[b][0]}].local_region", f"{rb} of {items[b][1].local_name} "
                                     f"overlaps shards[{items[a][0]}] {ra}: a receiver byte must have one source")


def region_to_proto(r: Region) -> data_pb2.TensorRegion:
    return data_pb2.TensorRegion(offsets=r.offsets, sizes=r.sizes)


def region_from_proto(pb: data_pb2.TensorRegion) -> Region:
    return Region(tuple(pb.offsets), tuple(pb.sizes))


def dtype_name(dtype: object) -> str:
    """`torch.bfloat16` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def canonical_shapes(layouts: Iterable[RankLayout]) -> Mapping[str, tuple[int, ...]]:
    return {s.canonical_name: s.canonical_shape for layout in layouts for s in layout.shards}
