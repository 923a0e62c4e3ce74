"""Full tensors, a stretch at a time, from whatever stores them: the export's source side.

An export writes each tensor as one row-major run of bytes; the source may hold it whole
(one entry, one or more stored ranges) or as the shards of a DTensor saved by many ranks
(each shard its own row-major box of the global tensor). :class:`Consolidator` fills any
stretch ``[start, end)`` of a tensor's exported bytes: the stretch is cut into boxes of the
global tensor (:func:`~aiosnap.load.reshard.box_pieces`), each box is intersected with the
stored shards, and the stored ranges that hold the intersection are read (neighbours of
one object with one request), verified (when the source records a crc32c) and copied into
place, converting the dtype when the export asks for another one.

The stored ranges come from a :class:`~.rangecache.RangeCache`, which charges every byte
to the RAM budget: read once while needed, verified, kept while the budget allows (the
parts of a file, filled in order, find the ranges the part before them read), or streamed
when larger than the budget allows. Runs on the event loop that calls it; the copies run
in worker threads.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import torch

from ...core.aio import complete_before_cancel
from ...core.tensorio import bytes_view
from ...errors import CorruptCheckpointError
from ...format.manifest import EntryRecord, Manifest, ShardRecord
from ...format.tiling import overlap, row_major_strides
from ...load.decode import torch_dtype
from ...load.reshard import box_pieces
from ...storage.base import Storage
from .rangecache import RangeCache, Want
from .writer import Segment

__all__ = ["Consolidator", "RangeCache"]

_Key = tuple[str, int]


@dataclass(frozen=True)
class _Copy:
    """Elements of one stored range going to one box of a window: ``shape`` elements with
    the stored shard's ``strides``, starting ``skip`` elements into the range, to the window
    elements at ``dest_offset`` with the global tensor's strides."""

    key: _Key
    dtype: torch.dtype
    skip: int
    shape: tuple[int, ...]
    strides: list[int]
    dest_offset: int
    dest_strides: list[int]


_Plan = tuple[tuple[torch.Tensor, memoryview, int, int, bool], list[Want], list[_Copy]]
"""(window, dest, where dest's bytes start and end in the window, whether the window is
dest itself), the stretches of stored ranges to read, the copies to make."""


class Consolidator:
    """Fills stretches of the exported bytes of ``manifest``'s entries (see the module
    docstring); ``out_dtypes`` gives an entry's exported dtype where it differs from the
    stored one."""

    def __init__(
        self, storage: Storage, manifest: Manifest, cache: RangeCache, out_dtypes: dict[int, torch.dtype] | None = None
    ) -> None:
        self.storage = storage
        self.manifest = manifest
        self.cache = cache
        self.out_dtypes = out_dtypes or {}

    async def fill(self, segments: list[Segment]) -> None:
        """Put each segment's bytes (an entry, by ``tensor.source``) into its buffer, in
        batches of at most a quarter of the cache's budget (so that the source bytes each
        batch reads fit in it, whatever the part size)."""
        for batch in _batches(segments, max(self.cache.budget.capacity // 4 // 64 * 64, 64)):
            plans = [self._plan(tensor.source, start, end, dest) for tensor, start, end, dest in batch]
            held = await self.cache.get([want for _, wants, _ in plans for want in wants])
            try:
                await complete_before_cancel(asyncio.to_thread(_copy_all, plans, held.data))
            finally:
                self.cache.release(held)

    def _plan(self, index: int, start: int, end: int, dest: memoryview) -> _Plan:
        """What filling bytes ``[start, end)`` of entry ``index`` takes: the window (a
        tensor of the exported dtype covering whole elements, and where the bytes wanted
        lie in it), the stored ranges to read and the copies to make."""
        entry = self.manifest.entries[index]
        stored = torch_dtype(entry.dtype)
        out = self.out_dtypes.get(index, stored)
        size = torch.empty(0, dtype=out).element_size()
        e0, e1 = start // size, -(-end // size)
        aligned = start % size == 0 and end % size == 0
        window = torch.frombuffer(dest, dtype=out) if aligned else torch.empty(e1 - e0, dtype=out)
        shape = tuple(entry.shape)
        strides = row_major_strides(shape)
        needed: dict[_Key, Want] = {}
        copies: list[_Copy] = []
        shards = entry.shard_records()
        for first, box_shape in box_pieces(0, shape, strides, e0, e1) if shape else [((), ())]:
            box = (tuple(first), tuple(box_shape))
            for shard in shards:
                found = overlap((tuple(shard.offsets), tuple(shard.shape)), box) if shape else ((), ())
                if found is not None and math.prod(found[1]) > 0:
                    self._plan_overlap(entry, stored, shard, found, strides, e0, needed, copies)
        return (window, dest, start - e0 * size, end - e0 * size, aligned), list(needed.values()), copies

    @staticmethod
    def _plan_overlap(
        entry: EntryRecord,
        stored: torch.dtype,
        shard: ShardRecord,
        found: tuple[tuple[int, ...], tuple[int, ...]],
        global_strides: list[int],
        e0: int,
        needed: dict[_Key, Want],
        copies: list[_Copy],
    ) -> None:
        itemsize = torch.empty(0, dtype=stored).element_size()
        offsets, shape = found
        local_strides = row_major_strides(tuple(shard.shape))
        first = sum((o - s) * st for o, s, st in zip(offsets, shard.offsets, local_strides, strict=True))
        last = first + sum((n - 1) * st for n, st in zip(shape, local_strides, strict=True))
        position = 0
        for r in shard.ranges:  # the shard's bytes, in order
            a, b = position, position + r.nbytes
            position = b
            if b <= first * itemsize or a > last * itemsize:
                continue
            if a % itemsize or b % itemsize:
                raise CorruptCheckpointError(f"{entry.path}: a stored byte range splits an element; cannot export it")
            key = (r.object, r.offset)
            for start, part_shape in box_pieces(first, shape, local_strides, a // itemsize, b // itemsize):
                at = first + sum(i * st for i, st in zip(start, local_strides, strict=True))
                dest = sum((o + i) * st for o, i, st in zip(offsets, start, global_strides, strict=True)) - e0
                skip = at - a // itemsize
                extent = 1 + sum((n - 1) * st for n, st in zip(part_shape, local_strides, strict=True))
                lo, hi = skip * itemsize, (skip + extent) * itemsize  # the bytes of the range it reads
                old = needed.get(key)
                needed[key] = Want(entry.path, r, lo, hi) if old is None else Want(
                    entry.path, r, min(old.lo, lo), max(old.hi, hi))  # fmt: skip
                copies.append(_Copy(key, stored, skip, part_shape, local_strides, dest, global_strides))


def _batches(segments: list[Segment], limit: int) -> list[list[Segment]]:
    """``segments`` cut into batches of at most ``limit`` bytes (a longer segment is split)."""
    batches: list[list[Segment]] = [[]]
    room = limit
    for tensor, start, end, dest in segments:
        while start < end:
            if room == 0:
                batches.append([])
                room = limit
            take = min(end - start, room)
            batches[-1].append((tensor, start, start + take, dest[:take]))
            dest = dest[take:]
            start += take
            room -= take
    return [b for b in batches if b]


def _copy_all(plans: list[_Plan], data: dict[_Key, tuple[bytearray, int]]) -> None:
    """Worker thread: make every planned copy (from each range's bytes, which start at
    some byte of the range), then put unaligned windows' bytes in place."""
    with torch.no_grad():
        for (window, dest, lo, hi, direct), _, copies in plans:
            for c in copies:
                held, base = data[c.key]
                source = torch.frombuffer(held, dtype=c.dtype)
                view = source.as_strided(c.shape, c.strides, c.skip - base // source.element_size())
                window.as_strided(c.shape, c.dest_strides, c.dest_offset).copy_(view)
            if not direct:
                dest[:] = bytes_view(window)[lo:hi]
