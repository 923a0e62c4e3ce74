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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..aio import complete_before_cancel, run_all
from ..format.manifest import ByteRange, EntryRecord, Manifest, ShardRecord
from ..format.tiling import Box, overlap
from ..storage.base import Storage
from ..tensorio import bytes_view
from .decode import torch_dtype
from .fetch_runs import Range, plan_runs, read_run
from .inplace import tensor_targets
from .staged import StagingSlabs

__all__ = ["ShardTarget", "read_into_targets", "shard_targets", "whole_target"]


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


def dtensor_target(target: torch.Tensor) -> ShardTarget:
    """The box of this rank's local shard of DTensor ``target``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = target.device_mesh, target.placements  # type: ignore[attr-defined]
    shape, offsets = compute_local_shape_and_global_offset(target.shape, mesh, placements)
    local = target._local_tensor  # type: ignore[attr-defined]  # the DTensor's own memory
    return ShardTarget(local, tuple(offsets), tuple(shape), target)


def whole_target(entry: EntryRecord) -> ShardTarget:
    """A new tensor for the whole of ``entry`` (a full tensor assembled from its shards)."""
    dest = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
    return ShardTarget(dest, (0,) * len(entry.shape), tuple(entry.shape), dest)


def shard_targets(manifest: Manifest, targets: Any, decode_key: Callable[[Any], Any]) -> dict[int, ShardTarget]:
    """Loop thread: entry id -> the caller's DTensor its bytes go to (a sharded entry or a
    whole one, of the same global shape and dtype)."""
    found: dict[int, ShardTarget] = {}
    for index, target in tensor_targets(manifest.tree, targets, decode_key):
        entry = manifest.entries[index]
        fits = list(target.shape) == entry.shape and str(target.dtype).removeprefix("torch.") == entry.dtype
        if fits and _is_dtensor(target):
            found[index] = dtensor_target(target)
    return found


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


def overlaps(manifest: Manifest, targets: dict[int, ShardTarget]) -> list[_Overlap]:
    """Every (stored shard, target) pair that shares elements."""
    found = []
    for index, target in targets.items():
        entry = manifest.entries[index]
        dtype = torch_dtype(entry.dtype)
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


async def _copy_overlap(storage: Storage, where: str, item: _Overlap) -> None:
    """Read the stored ranges that hold an overlap into one buffer (the target's own memory
    when the overlap is one contiguous stretch of it), verified, and copy it into place."""
    span = _Span.of(item)
    lo, hi = span.first * span.itemsize, (span.last + 1) * span.itemsize
    picked: list[ByteRange] = []
    position = start = 0
    for r in item.source.ranges:  # the shard's bytes, in order
        if position < hi and position + r.nbytes > lo:
            if not picked:
                start = position
            picked.append(r)
        position += r.nbytes
    dest = _narrowed(item)
    direct = _direct(item, dest)
    buffer = bytes_view(dest) if direct else memoryview(bytearray(sum(r.nbytes for r in picked)))
    ranges, at = [], 0
    for r in picked:
        ranges.append(Range(item.path, r, buffer[at : at + r.nbytes]))
        at += r.nbytes
    for run in plan_runs(ranges):
        await read_run(storage, where, run)
    if direct:
        return
    skip = lo - start  # ranges may split anywhere: cut the overlap's span out in bytes
    view = torch.frombuffer(buffer[skip : skip + hi - lo], dtype=item.dtype).as_strided(item.box[1], span.strides, 0)
    await complete_before_cancel(asyncio.to_thread(_copy, dest, view))


_Block = tuple[int, int, int, int, int]
"""Rows ``[r0, r1)`` of an overlap, the stored ranges ``[k0, k1)`` that hold them, and the
byte offset in the shard where range ``k0`` starts."""


def _row_blocks(item: _Overlap, span: _Span, slab_bytes: int) -> list[_Block] | None:
    """Split an overlap into blocks of whole rows whose stored ranges fit one slab together
    (each range is read whole: its crc32c covers all of it). None when one row alone needs
    more than a slab (the overlap is then read in one piece, as before)."""
    starts = [0]
    for r in item.source.ranges:
        starts.append(starts[-1] + r.nbytes)
    shape, strides = item.box[1], span.strides
    rows = shape[0] if shape else 1
    row_step = strides[0] if shape else 0
    row_span = sum((n - 1) * st for n, st in zip(shape[1:], strides[1:], strict=True)) + 1

    def needed(r0: int, r1: int) -> tuple[int, int]:
        lo = (span.first + r0 * row_step) * span.itemsize
        hi = (span.first + (r1 - 1) * row_step + row_span) * span.itemsize
        return bisect.bisect_right(starts, lo) - 1, bisect.bisect_left(starts, hi)

    def fits(r0: int, r1: int) -> bool:
        k0, k1 = needed(r0, r1)
        return starts[k1] - starts[k0] <= slab_bytes

    blocks: list[_Block] = []
    r0 = 0
    while r0 < rows:
        if not fits(r0, r0 + 1):
            return None
        low, high = r0 + 1, rows  # the most rows from r0 that fit: binary search
        while low < high:
            middle = (low + high + 1) // 2
            if fits(r0, middle):
                low = middle
            else:
                high = middle - 1
        k0, k1 = needed(r0, low)
        blocks.append((r0, low, k0, k1, starts[k0]))
        r0 = low
    return blocks


async def _copy_block(
    storage: Storage,
    where: str,
    item: _Overlap,
    span: _Span,
    block: _Block,
    slabs: StagingSlabs,
    limit: asyncio.Semaphore,
) -> None:
    """Read the stored ranges of one block of rows into a slab, verified, and copy those
    rows into their place in the target. A slab first, then a read permit (as every load
    that holds a slab: the other order could deadlock)."""
    r0, r1, k0, k1, start = block
    shape = item.box[1]
    slab_id, slab = await slabs.acquire()
    try:
        buffer = bytes_view(slab)
        ranges, at = [], 0
        for r in item.source.ranges[k0:k1]:
            ranges.append(Range(item.path, r, buffer[at : at + r.nbytes]))
            at += r.nbytes
        for run in plan_runs(ranges):
            async with limit:
                await read_run(storage, where, run)
        block_shape = (r1 - r0, *shape[1:]) if shape else ()
        block_first = span.first + (r0 * span.strides[0] if shape else 0)
        count = sum((n - 1) * st for n, st in zip(block_shape, span.strides, strict=True)) + 1
        skip = block_first * span.itemsize - start  # ranges may split anywhere: cut in bytes
        source = buffer[skip : skip + count * span.itemsize]
        view = torch.frombuffer(source, dtype=item.dtype).as_strided(block_shape, span.strides, 0)
        dest = _narrowed(item)
        target = dest.narrow(0, r0, r1 - r0) if shape else dest
        await complete_before_cancel(asyncio.to_thread(_copy, target, view))
    finally:
        slabs.release(slab_id)


def _copy(dest: torch.Tensor, view: torch.Tensor) -> None:
    with torch.no_grad():
        dest.copy_(view)


async def read_into_targets(
    storage: Storage, where: str, items: list[_Overlap], limit: asyncio.Semaphore, slabs: StagingSlabs | None = None
) -> None:
    """Read and verify every overlap, copying each into its target. An overlap that is one
    contiguous stretch of its target is read straight into it; with ``slabs``, any other
    goes through them a block of rows at a time (in the RAM budget); else through a buffer
    of its own size (at most ``limit`` such overlaps at a time)."""

    async def one(item: _Overlap) -> None:
        span = _Span.of(item)
        if slabs is not None and not _direct(item, _narrowed(item)):
            blocks = _row_blocks(item, span, slabs.slab_bytes)
            if blocks is not None:
                for block in blocks:
                    await _copy_block(storage, where, item, span, block, slabs, limit)
                return
        async with limit:
            await _copy_overlap(storage, where, item)

    await run_all(one(item) for item in items)
