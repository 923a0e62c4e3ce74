"""Loading sharded entries, and any entry into a DTensor: resharding reads.

A checkpoint saved by N ranks loads into M ranks with any mesh and placements. Each target
is a box of the global tensor: a DTensor's local shard (where this rank's mesh coordinate and
placements put it), or the whole tensor (a plain target, or a load without a state, which
assembles full tensors). For each stored shard that overlaps the box, only the byte ranges
that cover the overlap are read (a stored shard is contiguous and row-major, so the overlap
lies within one span of it), each range's crc32c is checked, and the overlap is copied into
the target's memory: in place, into the DTensor's own local tensor. Where the stored shard
fills one contiguous stretch of the target (the same sharding as at save time, or whole row
blocks of it) it is read straight into that memory.

- :func:`shard_targets` runs on the loop thread while the load is planned (tensor metadata only).
- :func:`read_into_targets` runs on the loop thread; copies run in worker threads, at most
  ``concurrency`` overlaps at a time, so staging memory stays bounded by the largest shards.
"""

from __future__ import annotations

import asyncio
import bisect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..core.aio import complete_before_cancel, run_all
from ..core.placements import local_boxes
from ..core.tensorio import bytes_view, copyable
from ..format.manifest import EntryRecord, Manifest, ShardRecord
from ..format.tiling import Box, overlap
from ..storage.base import Storage
from .decode import torch_dtype
from .fetch_runs import back_to_back, read_in_turn
from .inplace import tensor_targets
from .staged import StagingSlabs

__all__ = ["ShardTarget", "Targets", "box_pieces", "read_into_targets", "shard_targets", "whole_target"]


@dataclass(frozen=True)
class ShardTarget:
    """Where entry's bytes go: ``dest`` holds the box (``offsets``, ``shape``) of the
    global tensor; ``value`` is what the load hands back for the entry."""

    dest: torch.Tensor
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    value: torch.Tensor


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and isinstance(value, torch.Tensor)


def dtensor_targets(target: torch.Tensor, path: str) -> tuple[ShardTarget, ...]:
    """The boxes of this rank's local shard of DTensor ``target`` (one, unless a
    ``_StridedShard`` layout holds several stretches of a dimension: :mod:`aiosnap.core.placements`),
    each with the part of the DTensor's own memory that holds it."""
    mesh, placements = target.device_mesh, target.placements  # type: ignore[attr-defined]
    local = target._local_tensor  # type: ignore[attr-defined]  # the DTensor's own memory
    return tuple(
        ShardTarget(box.view(local), box.offsets, box.shape, target)
        for box in local_boxes(target.shape, mesh, placements, path)
    )


def whole_target(entry: EntryRecord) -> ShardTarget:
    """A new tensor for the whole of ``entry`` (a full tensor assembled from its shards)."""
    dest = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
    return ShardTarget(dest, (0,) * len(entry.shape), tuple(entry.shape), dest)


Targets = Mapping[int, ShardTarget | tuple[ShardTarget, ...]]
"""Entry id -> where its bytes go: one box, or the boxes of one DTensor's local shard."""


def shard_targets(
    manifest: Manifest, targets: Any, decode_key: Callable[[Any], Any]
) -> dict[int, tuple[ShardTarget, ...]]:
    """Loop thread: entry id -> the boxes of the caller's DTensor its bytes go to (a
    sharded entry or a whole one, of the same global shape, and the same dtype or both
    floating point: the copy into the DTensor's memory converts, a load of bfloat16 weights
    into float32 ones)."""
    found: dict[int, tuple[ShardTarget, ...]] = {}
    for index, target in tensor_targets(manifest.tree, targets, decode_key):
        entry = manifest.entries[index]
        dtype = str(target.dtype).removeprefix("torch.")
        same_kind = dtype == entry.dtype or (dtype in _CONVERTIBLE and entry.dtype in _CONVERTIBLE)
        fits = list(target.shape) == entry.shape and same_kind
        if fits and _is_dtensor(target):
            found[index] = dtensor_targets(target, entry.path)
    return found


_CONVERTIBLE = {"float16", "bfloat16", "float32", "float64"}
"""Dtypes a load into a DTensor converts between."""


def _strides(shape: tuple[int, ...] | list[int]) -> list[int]:
    stride, step = [], 1
    for d in reversed(shape):
        stride.append(step)
        step *= d
    return stride[::-1]


@dataclass(frozen=True)
class _Overlap:
    path: str
    source: ShardRecord
    box: Box
    target: ShardTarget
    dtype: torch.dtype


def overlaps(manifest: Manifest, targets: Targets) -> list[_Overlap]:
    """Every (stored shard, target box) pair that shares elements."""
    found = []
    for index, boxes in targets.items():
        entry = manifest.entries[index]
        dtype = torch_dtype(entry.dtype)
        for target in (boxes,) if isinstance(boxes, ShardTarget) else boxes:
            wanted = (target.offsets, target.shape)
            if entry.shards is None:
                box = overlap(((0,) * len(entry.shape), tuple(entry.shape)), wanted)
                if box is not None and math.prod(box[1]) > 0:
                    found.append(_Overlap(entry.path, entry.shard_records()[0], box, target, dtype))
                continue
            for stored in entry.shards:  # 10^4 shards at scale: views made only for those that overlap
                box = overlap((tuple(stored[0]), tuple(stored[1])), wanted)
                if box is not None and math.prod(box[1]) > 0:
                    found.append(_Overlap(entry.path, ShardRecord.of(stored), box, target, dtype))
    return found


def _narrowed(item: _Overlap) -> torch.Tensor:
    """The part of the target's memory that the overlap fills."""
    dest = item.target.dest
    for dim, (o, n) in enumerate(zip(*item.box, strict=True)):
        dest = dest.narrow(dim, o - item.target.offsets[dim], n)
    return dest


def _direct(item: _Overlap, dest: torch.Tensor) -> bool:
    """The whole stored shard lands in one contiguous stretch of the target's memory
    (the same sharding as at save time, or whole row blocks of it): read straight into it."""
    source = item.source
    return (
        tuple(source.offsets) == item.box[0]
        and tuple(source.shape) == item.box[1]
        and dest.device.type == "cpu"
        and dest.is_contiguous()
        and dest.dtype == item.dtype
        and not dest.is_conj()
        and not dest.is_neg()
    )


@dataclass(frozen=True)
class _Span:
    """Where an overlap lies in its stored shard: the shard's row-major ``strides``, the
    element offset ``first`` of its first element and ``last`` of its last one."""

    strides: list[int]
    first: int
    last: int
    itemsize: int

    @classmethod
    def of(cls, item: _Overlap) -> _Span:
        source, (offsets, shape) = item.source, item.box
        strides = _strides(source.shape)
        local = [o - s for o, s in zip(offsets, source.offsets, strict=True)]
        first = sum(i * st for i, st in zip(local, strides, strict=True))
        last = first + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
        return cls(strides, first, last, torch.empty(0, dtype=item.dtype).element_size())


def _needed(item: _Overlap, span: _Span) -> tuple[list[int], int, int]:
    """Where each stored range of the shard starts (and where the last ends), and the
    ranges ``[k0, k1)`` that hold the overlap's span."""
    starts = [0]
    for r in item.source.ranges:  # the shard's bytes, in order
        starts.append(starts[-1] + r.nbytes)
    lo, hi = span.first * span.itemsize, (span.last + 1) * span.itemsize
    return starts, bisect.bisect_right(starts, lo) - 1, bisect.bisect_left(starts, hi)


async def _copy_overlap(storage: Storage, where: str, item: _Overlap) -> None:
    """Read the stored ranges that hold an overlap into one buffer (the target's own memory
    when the overlap is one contiguous stretch of it), verified, and copy it into place."""
    span = _Span.of(item)
    starts, k0, k1 = _needed(item, span)
    lo, hi = span.first * span.itemsize, (span.last + 1) * span.itemsize
    dest = _narrowed(item)
    direct = _direct(item, dest)
    buffer = bytes_view(dest) if direct else memoryview(bytearray(starts[k1] - starts[k0]))
    await read_in_turn(storage, where, back_to_back(item.path, item.source.ranges[k0:k1], buffer), None)
    if direct:
        return
    skip = lo - starts[k0]  # ranges may split anywhere: cut the overlap's span out in bytes
    view = torch.frombuffer(buffer[skip : skip + hi - lo], dtype=item.dtype).as_strided(item.box[1], span.strides, 0)
    await complete_before_cancel(asyncio.to_thread(_copy, dest, view))


Piece = tuple[tuple[int, ...], tuple[int, ...]]
"""A sub-box of an overlap: its start (relative to the overlap's) and its shape."""


def box_pieces(first: int, shape: tuple[int, ...], strides: list[int], a: int, b: int) -> list[Piece]:
    """The elements of a box whose positions in a row-major stored shard lie in ``[a, b)``,
    as a few sub-boxes: the box's element 0 is at position ``first``, and one step along
    dimension ``d`` moves ``strides[d]`` positions. The elements of a box lie in the shard
    in the box's own row-major order, so those within ``[a, b)`` are a run of it: whole
    slices along the first dimension, with at most a partial slice at either end (split
    the same way along the next dimension)."""
    pieces: list[Piece] = []
    ndim = len(shape)

    def walk(start: list[int], dim: int, base: int) -> None:
        if dim == ndim:  # one element
            if a <= base < b:
                pieces.append((tuple(start), (1,) * ndim))
            return
        n, step = shape[dim], strides[dim]
        extent = sum((shape[d] - 1) * strides[d] for d in range(dim + 1, ndim))  # one slice's, less one
        touch_lo = max(0, -((base + extent - a) // step))  # first slice ending at or after a
        touch_hi = min(n - 1, (b - 1 - base) // step)  # last slice starting before b
        if touch_lo > touch_hi:
            return
        full_lo = max(touch_lo, -((base - a) // step))  # first slice starting at or after a
        full_hi = min(touch_hi, (b - 1 - extent - base) // step)  # last slice ending before b
        if full_lo > full_hi:  # no whole slice: at most two partial ones
            full_lo, full_hi = touch_hi + 1, touch_hi
        for i in range(touch_lo, min(full_lo, touch_hi + 1)):
            walk([*start[:dim], i, *start[dim + 1 :]], dim + 1, base + i * step)
        if full_lo <= full_hi:
            sub_start = [*start[:dim], full_lo, *([0] * (ndim - dim - 1))]
            sub_shape = (*([1] * dim), full_hi - full_lo + 1, *shape[dim + 1 :])
            pieces.append((tuple(sub_start), tuple(sub_shape)))
        for i in range(max(full_hi + 1, touch_lo), touch_hi + 1):
            if full_lo <= i <= full_hi:
                continue
            walk([*start[:dim], i, *start[dim + 1 :]], dim + 1, base + i * step)

    walk([0] * ndim, 0, first)
    return pieces


_Group = tuple[int, int]
"""Stored ranges ``[k0, k1)`` of a shard, read into one slab together."""


def _range_groups(item: _Overlap, span: _Span, slab_bytes: int) -> tuple[list[int], list[_Group]] | None:
    """The stored ranges an overlap needs, in groups that fit one slab each (each range is
    read whole, once: its crc32c covers all of it), and where each range starts in the
    shard. None when a range is larger than a slab, or a range boundary inside the overlap
    cuts an element (a forged manifest): the overlap is then read in one piece, as before."""
    starts, k0, k1 = _needed(item, span)
    if any(starts[k] % span.itemsize for k in range(k0 + 1, k1)):
        return None
    groups: list[_Group] = []
    begin = k0
    for k in range(k0, k1):
        if starts[k + 1] - starts[k] > slab_bytes:
            return None
        if starts[k + 1] - starts[begin] > slab_bytes:
            groups.append((begin, k))
            begin = k
    groups.append((begin, k1))
    return starts, groups


async def _copy_group(
    storage: Storage,
    where: str,
    item: _Overlap,
    span: _Span,
    starts: list[int],
    group: _Group,
    slabs: StagingSlabs,
    limit: asyncio.Semaphore,
) -> None:
    """Read one group of stored ranges into a slab, verified, and copy the overlap's
    elements they hold into place. A slab first, then a read permit (as every load that
    holds a slab: the other order could deadlock)."""
    k0, k1 = group
    slab_id, slab = await slabs.acquire()
    try:
        buffer = bytes_view(slab)
        await read_in_turn(storage, where, back_to_back(item.path, item.source.ranges[k0:k1], buffer), limit)
        size = span.itemsize
        a, b = starts[k0] // size, starts[k1] // size  # element positions (boundaries hold whole elements)
        copies = []
        dest = _narrowed(item)
        for start, shape in box_pieces(span.first, item.box[1], span.strides, a, b):
            first = span.first + sum(i * st for i, st in zip(start, span.strides, strict=True))
            count = sum((n - 1) * st for n, st in zip(shape, span.strides, strict=True)) + 1
            skip = first * size - starts[k0]
            view = torch.frombuffer(buffer[skip : skip + count * size], dtype=item.dtype)
            target = dest
            for dim, (offset, n) in enumerate(zip(start, shape, strict=True)):
                target = target.narrow(dim, offset, n)
            copies.append((target, view.as_strided(shape, span.strides, 0)))
        await complete_before_cancel(asyncio.to_thread(_copy_all, copies))
    finally:
        slabs.release(slab_id)


def _copy_all(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dest, view in copies:
        _copy(dest, view)


def _copy(dest: torch.Tensor, view: torch.Tensor) -> None:
    with torch.no_grad():
        copyable(dest).copy_(copyable(view))


async def read_into_targets(
    storage: Storage, where: str, items: list[_Overlap], limit: asyncio.Semaphore, slabs: StagingSlabs | None = None
) -> None:
    """Read and verify every overlap, copying each into its target. An overlap that is one
    contiguous stretch of its target is read straight into it; with ``slabs``, any other
    goes through them a slab of stored ranges at a time (in the RAM budget), each range
    read once; else through a buffer of its own size (at most ``limit`` such overlaps at a
    time)."""

    async def one(item: _Overlap) -> None:
        span = _Span.of(item)
        if slabs is not None and not _direct(item, _narrowed(item)):
            grouped = _range_groups(item, span, slabs.slab_bytes)
            if grouped is not None:
                starts, groups = grouped
                for group in groups:
                    await _copy_group(storage, where, item, span, starts, group, slabs, limit)
                return
        async with limit:
            await _copy_overlap(storage, where, item)

    await run_all(one(item) for item in items)
