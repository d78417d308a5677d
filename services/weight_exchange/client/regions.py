"""Rectangular regions of tensors: intersection, containment, splitting, slicing. Pure, no I/O."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple


class Region(NamedTuple):
    """A box: per-dimension offsets and sizes (row-major order of its elements is the wire order)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def full(cls, shape: Sequence[int]) -> Region:
        return cls(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @classmethod
    def of(cls, offsets: Sequence[int], sizes: Sequence[int]) -> Region:
        return cls(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes, strict=True))

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True))

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(
            o >= 0 and s >= 0 and o + s <= d for o, s, d in zip(self.offsets, self.sizes, shape, strict=True))

    def contains(self, other: Region) -> bool:
        return all(a <= b and b + t <= a + s for a, s, b, t in
                   zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True))

    def intersect(self, other: Region) -> Region | None:
        offs, sizes = [], []
        for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True):
            lo, hi = max(a, b), min(a + s, b + t)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Region(tuple(offs), tuple(sizes))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes, strict=True)) + "]"


def grid(box: Region, others: Sequence[Region]) -> Iterator[Region]:
    """Cut `box` along every boundary of `others` that falls inside it; yields the cells in row-major order."""
    cuts: list[list[int]] = []
    for d in range(box.ndim):
        lo, hi = box.offsets[d], box.offsets[d] + box.sizes[d]
        points = {lo, hi}
        for o in others:
            for p in (o.offsets[d], o.offsets[d] + o.sizes[d]):
                if lo < p < hi:
                    points.add(p)
        cuts.append(sorted(points))
    yield from _cells(cuts, 0, (), ())


def _cells(cuts: list[list[int]], d: int, offs: tuple[int, ...], sizes: tuple[int, ...]) -> Iterator[Region]:
    if d == len(cuts):
        yield Region(offs, sizes)
        return
    points = cuts[d]
    for lo, hi in zip(points, points[1:], strict=False):
        yield from _cells(cuts, d + 1, offs + (lo,), sizes + (hi - lo,))


def split(region: Region, itemsize: int, max_bytes: int) -> list[Region]:
    """Cut a region into row-major-ordered pieces of at most `max_bytes` (a single element may exceed it)."""
    if region.numel * itemsize <= max_bytes or region.numel == 0:
        return [region]
    d = next((i for i, s in enumerate(region.sizes) if s > 1), None)
    if d is None:
        return [region]
    inner = itemsize * math.prod(region.sizes[d + 1:])
    pieces: list[Region] = []
    if inner <= max_bytes:
        step = max(1, max_bytes // inner)
        for start in range(0, region.sizes[d], step):
            n = min(step, region.sizes[d] - start)
            pieces.append(_narrow(region, d, start, n))
        return pieces
    for start in range(region.sizes[d]):
        pieces.extend(split(_narrow(region, d, start, 1), itemsize, max_bytes))
    return pieces


def _narrow(region: Region, d: int, start: int, n: int) -> Region:
    offs = list(region.offsets)
    sizes = list(region.sizes)
    offs[d] += start
    sizes[d] = n
    return Region(tuple(offs), tuple(sizes))
