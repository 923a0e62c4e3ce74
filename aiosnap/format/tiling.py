"""Shard boxes of a sharded tensor: each a hyper-rectangle of the global tensor
(``offsets``, ``shape``); together they must tile it exactly, with no gap and no overlap.

Pure code on plain integers (no torch); checks untrusted input read back from storage in
O(shards log shards), whatever the number of ranks (a pairwise overlap test would be
quadratic: 8,192 shards of one tensor are 33 million pairs). Every sharding DTensor makes
(``Shard``/``Replicate`` placements on any mesh, uneven included) cuts each dimension into
intervals and takes every combination of them: a grid. So the check is that each
dimension's intervals partition it and that every cell of that grid is there once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["Box", "check_tiling", "overlap", "row_major_strides"]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, shape) of a shard in the global tensor."""


def check_tiling(shape: Sequence[int], boxes: Sequence[Box]) -> None:
    """Raise ValueError unless the non-empty ``boxes`` tile ``shape`` as a grid."""
    ndim = len(shape)
    cells: set[Box] = set()
    cuts: list[set[tuple[int, int]]] = [set() for _ in range(ndim)]
    for offsets, sizes in boxes:
        if len(offsets) != ndim or len(sizes) != ndim:
            raise ValueError(f"a shard of {ndim} dimension(s) has offsets {list(offsets)} and shape {list(sizes)}")
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
            raise ValueError(f"shard at {list(offsets)} of shape {list(sizes)} lies outside {list(shape)}")
        if math.prod(sizes) == 0:
            continue
        if (offsets, sizes) in cells:
            raise ValueError(f"shard at {list(offsets)} of shape {list(sizes)} is stored twice")
        cells.add((tuple(offsets), tuple(sizes)))
        for dim in range(ndim):
            cuts[dim].add((offsets[dim], sizes[dim]))
    if math.prod(shape) == 0:
        if cells:
            raise ValueError(f"an empty tensor of shape {list(shape)} has non-empty shards")
        return
    for dim, found in enumerate(cuts):
        position = 0
        for start, size in sorted(found):
            if start != position:
                what = "a gap" if start > position else "overlapping shards"
                raise ValueError(f"dimension {dim}: {what} at index {min(start, position)}")
            position = start + size
        if position != shape[dim]:
            raise ValueError(f"dimension {dim}: shards end at {position}, not at its size {shape[dim]}")
    if len(cells) != math.prod(len(found) for found in cuts):
        raise ValueError(f"the shards do not cover every part of {list(shape)} (they are not a grid)")


def overlap(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` cover, or None when they share no element."""
    offsets: list[int] = []
    sizes: list[int] = []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1], strict=True):
        start, end = max(ao, bo), min(ao + asz, bo + bsz)
        if end <= start:
            return None
        offsets.append(start)
        sizes.append(end - start)
    return tuple(offsets), tuple(sizes)


def row_major_strides(shape: Sequence[int]) -> list[int]:
    """The strides (in elements) of a contiguous row-major tensor of ``shape`` (a dimension
    of size 0 counts as 1, as torch does)."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return stride[::-1]
