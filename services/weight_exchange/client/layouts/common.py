"""Building blocks of sharded layouts: row segments of fused tensors, column splits, padded vocab rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from services.common.errors import FieldError
from services.weight_exchange.client.layout import Shard
from services.weight_exchange.client.regions import Region


class Segment(NamedTuple):
    """`rows` rows of canonical tensor `name`, starting at canonical row `start`, at local row `local`."""

    name: str
    start: int
    rows: int
    local: int = 0


def even(total: int, parts: int, rank: int, what: str) -> tuple[int, int]:
    """(start, size) of part `rank` of `total` split evenly; ValueError naming `what` when it does not divide."""
    if parts <= 0 or not 0 <= rank < parts:
        raise FieldError(what, f"rank {rank} of {parts} is invalid")
    if total % parts:
        raise FieldError(what, f"{total} is not divisible by {parts}")
    size = total // parts
    return rank * size, size


def stack(parts: Sequence[tuple[str, int, int]]) -> list[Segment]:
    """Concatenate (name, start, rows) blocks into one local tensor's rows."""
    out, at = [], 0
    for name, start, rows in parts:
        out.append(Segment(name, start, rows, at))
        at += rows
    return out


def window(segments: Sequence[Segment], start: int, size: int) -> list[Segment]:
    """The part of a row map that falls in local rows [start, start+size), renumbered from 0."""
    out = []
    for s in segments:
        lo, hi = max(s.local, start), min(s.local + s.rows, start + size)
        if hi > lo:
            out.append(Segment(s.name, s.start + lo - s.local, hi - lo, lo - start))
    return out


def row_shards(local_name: str, local_shape: tuple[int, ...], dtype: str, segments: Sequence[Segment],
               canonical: dict[str, tuple[int, ...]], lead: tuple[int, ...] = ()) -> list[Shard]:
    """Shards of a local tensor whose rows (after `lead` indices) are segments of canonical tensors."""
    out = []
    for s in segments:
        shape = canonical[s.name]
        rest = tuple(shape[1:])
        out.append(Shard(s.name, shape, dtype, Region((s.start,) + (0,) * len(rest), (s.rows, *rest)),
                         local_name, local_shape,
                         Region(lead + (s.local,) + (0,) * len(rest), (1,) * len(lead) + (s.rows, *rest))))
    return out


def col_shard(local_name: str, local_shape: tuple[int, ...], dtype: str, name: str, canonical_shape: tuple[int, ...],
              start: int, cols: int, lead: tuple[int, ...] = ()) -> Shard:
    """A row-parallel piece: canonical columns [start, start+cols) are the local tensor's columns."""
    rows = canonical_shape[0]
    return Shard(name, canonical_shape, dtype, Region((0, start), (rows, cols)), local_name, local_shape,
                 Region(lead + (0, 0), (1,) * len(lead) + (rows, cols)))


def replicated(local_name: str, name: str, shape: tuple[int, ...], dtype: str) -> Shard:
    return Shard(name, shape, dtype, Region.full(shape), local_name, shape, Region.full(shape))


def vocab_shard(local_name: str, name: str, vocab: int, hidden: int, padded: int, tp: int, rank: int,
                dtype: str) -> list[Shard]:
    """Vocab-parallel rows: rank r holds padded rows [r*p, (r+1)*p); padding rows hold no canonical bytes."""
    start, size = even(padded, tp, rank, "vocab (padded)")
    rows = max(0, min(vocab, start + size) - start)
    if rows == 0:
        return []
    return [Shard(name, (vocab, hidden), dtype, Region((start, 0), (rows, hidden)), local_name, (size, hidden),
                  Region((0, 0), (rows, hidden)))]


def pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
