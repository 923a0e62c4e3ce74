"""Full tensors, a stretch at a time, from whatever stores them: the export's source side.

An export writes each tensor as one row-major run of bytes; the source may hold it whole
(one entry, one or more stored ranges) or as the shards of a DTensor saved by many ranks
(each shard its own row-major box of the global tensor). :class:`Consolidator` fills any
stretch ``[start, end)`` of a tensor's exported bytes: the stretch is cut into boxes of the
global tensor (:func:`~aiosnap.load.reshard.box_pieces`), each box is intersected with the
stored shards, and the stored ranges that hold the intersection are read (neighbours of
one object with one request), verified (when the source records a crc32c) and copied into
place, converting the dtype when the export asks for another one.

Each stored range is read once while it is needed: verified ranges are kept in a cache of
bounded size (least recently used go first), so the parts of a file, filled in order, find
the ranges the part before them read (a 64 MiB range feeds eight 8 MiB parts; a row-sharded
tensor's shards feed the parts in turn). Runs on the event loop that calls it; the copies
run in worker threads.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ...core.aio import complete_before_cancel
from ...core.tensorio import bytes_view
from ...errors import CorruptCheckpointError
from ...format.manifest import ByteRange, EntryRecord, Manifest, ShardRecord
from ...format.tiling import overlap, row_major_strides
from ...load.decode import torch_dtype
from ...load.fetch_runs import Range, plan_runs, read_run
from ...load.reshard import box_pieces
from ...storage.base import Storage
from .writer import Segment

__all__ = ["Consolidator", "RangeCache"]

_Key = tuple[str, int]


class RangeCache:
    """Verified stored ranges by (object, offset), at most ``limit`` bytes of them kept
    (a range in use is kept by its users; one larger than ``limit`` is read all the same).
    Loop thread."""

    def __init__(self, storage: Storage, where: str, limit: int) -> None:
        self.storage = storage
        self.where = where
        self.limit = limit
        self._kept: OrderedDict[_Key, bytearray] = OrderedDict()
        self._reading: dict[_Key, asyncio.Future[bytearray]] = {}
        self._bytes = 0
        self.bytes_read = 0

    async def get_all(self, wanted: list[tuple[str, ByteRange]]) -> dict[_Key, bytearray]:
        """The bytes of every range (path, range) of ``wanted``; the missing ones are read
        with as few requests as neighbouring ranges allow, each range verified."""
        found: dict[_Key, bytearray] = {}
        waits: dict[_Key, asyncio.Future[bytearray]] = {}
        missing: list[Range] = []
        mine: dict[_Key, asyncio.Future[bytearray]] = {}
        for path, r in wanted:
            key = (r.object, r.offset)
            if key in found or key in waits or key in mine:
                continue
            if key in self._kept:
                self._kept.move_to_end(key)
                found[key] = self._kept[key]
            elif key in self._reading:
                waits[key] = self._reading[key]
            else:
                buffer = bytearray(r.nbytes)
                found[key] = buffer
                missing.append(Range(path, r, memoryview(buffer)))
                mine[key] = self._reading[key] = asyncio.get_running_loop().create_future()
        try:
            for run in plan_runs(missing):
                await read_run(self.storage, self.where, run)
                self.bytes_read += run.end - run.start
        except BaseException as exc:
            for key, future in mine.items():
                self._reading.pop(key, None)
                if not future.done():
                    future.set_exception(exc)
                    future.exception()  # seen by those waiting, if any
            raise
        for key, future in mine.items():
            self._reading.pop(key, None)
            future.set_result(found[key])
            self._keep(key, found[key])
        for key, future in waits.items():
            found[key] = await future
        return found

    def _keep(self, key: _Key, data: bytearray) -> None:
        self._kept[key] = data
        self._bytes += len(data)
        while self._bytes > self.limit and len(self._kept) > 1:
            _, old = self._kept.popitem(last=False)
            self._bytes -= len(old)


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


_Plan = tuple[tuple[torch.Tensor, memoryview, int, int, bool], list[ByteRange], list[_Copy]]
"""(window, dest, where dest's bytes start and end in the window, whether the window is
dest itself), the stored ranges to read, the copies to make."""


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
        """Put each segment's bytes (an entry, by ``tensor.source``) into its buffer."""
        plans = [self._plan(tensor.source, start, end, dest) for tensor, start, end, dest in segments]
        wanted = [(self.manifest.entries[tensor.source].path, r) for (tensor, *_), (_, needed, _) in
                  zip(segments, plans, strict=True) for r in needed]  # fmt: skip
        data = await self.cache.get_all(wanted)
        await complete_before_cancel(asyncio.to_thread(_copy_all, plans, data))

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
        needed: dict[_Key, ByteRange] = {}
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
        needed: dict[_Key, ByteRange],
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
            needed[(r.object, r.offset)] = r
            for start, part_shape in box_pieces(first, shape, local_strides, a // itemsize, b // itemsize):
                at = first + sum(i * st for i, st in zip(start, local_strides, strict=True))
                dest = sum((o + i) * st for o, i, st in zip(offsets, start, global_strides, strict=True)) - e0
                key = (r.object, r.offset)
                skip = at - a // itemsize
                copies.append(_Copy(key, stored, skip, part_shape, local_strides, dest, global_strides))


def _copy_all(plans: list[_Plan], data: dict[_Key, bytearray]) -> None:
    """Worker thread: make every planned copy, then put unaligned windows' bytes in place."""
    with torch.no_grad():
        for (window, dest, lo, hi, direct), _, copies in plans:
            for c in copies:
                source = torch.frombuffer(data[c.key], dtype=c.dtype)
                view = source.as_strided(c.shape, c.strides, c.skip)
                window.as_strided(c.shape, c.dest_strides, c.dest_offset).copy_(view)
            if not direct:
                dest[:] = bytes_view(window)[lo:hi]
