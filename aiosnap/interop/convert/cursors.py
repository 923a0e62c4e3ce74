"""Reading one entry's full bytes (row-major) from its source, in order, into whatever
buffer the export fills next -- each stored range read once.

- :class:`PlainCursor`, for an entry stored whole (its ranges are its bytes in order): the
  part of each stored range that a request covers is read straight into the request's
  buffer; its crc32c is computed there, and once every part of a range is read their crcs
  are combined and checked against the manifest's (a range that straddles two requests is
  read in two parts, not twice).
- :class:`ShardedCursor`, for an entry saved as shards by many ranks: the full tensor is
  assembled a window of rows at a time (at most a slab, or one row) by the resharding reads
  of :mod:`aiosnap.load.reshard` (the stored ranges each window needs, verified), and served
  from there. A stored range that two windows need is read for each (only when a band of
  shards along the first dimension is larger than a slab).

Coroutines on the export's loop; copies and checksums in worker threads.
"""

from __future__ import annotations

import asyncio
import bisect
import math

import torch

from ...core.checksums import crc32c_combine, crc32c_of
from ...core.tensorio import bytes_view
from ...errors import ChecksumMismatchError, CorruptCheckpointError, TruncatedObjectError
from ...format.manifest import ByteRange, EntryRecord
from ...load.decode import torch_dtype
from ...load.fetch_runs import Range, Run, read_run
from ...load.reshard import ShardTarget, overlaps, read_into_targets
from ...load.staged import StagingSlabs
from ...storage.base import Storage
from .selection import stub_manifest

__all__ = ["Cursor", "PlainCursor", "ShardedCursor", "cursor_for"]


class PlainCursor:
    """Serves the bytes of a whole entry (see the module)."""

    def __init__(self, storage: Storage, entry: EntryRecord, where: str, limit: asyncio.Semaphore) -> None:
        self.storage = storage
        self.entry = entry
        self.where = where
        self.limit = limit
        self.starts = [0]
        for r in entry.ranges:
            self.starts.append(self.starts[-1] + r.nbytes)
        self.parts: dict[int, list[tuple[int, int, int]]] = {}  # range -> (offset in it, size, crc)
        self._inflated: tuple[int, memoryview] | None = None  # the last compressed range, decompressed
        self._inflating = asyncio.Lock()

    async def serve(self, start: int, end: int, dest: memoryview) -> None:
        """Bytes ``[start, end)`` of the entry into ``dest``."""
        first = bisect.bisect_right(self.starts, start) - 1
        reads = []
        for k in range(max(first, 0), len(self.entry.ranges)):
            lo, hi = self.starts[k], self.starts[k + 1]
            if lo >= end:
                break
            a, b = max(start, lo), min(end, hi)
            if a < b:
                reads.append(self._part(k, a - lo, dest[a - start : b - start]))
        await asyncio.gather(*reads)

    async def _raw(self, k: int) -> memoryview:
        """Compressed range ``k`` decompressed and verified (kept until another is asked for:
        a writer asks for an entry's bytes in order)."""
        async with self._inflating:
            if self._inflated is None or self._inflated[0] != k:
                self._inflated = None
                stored = self.entry.ranges[k]
                raw = memoryview(bytearray(stored.nbytes))
                async with self.limit:
                    await read_run(self.storage, self.where, Run(stored.object, [Range(self.entry.path, stored, raw)]))
                self._inflated = (k, raw)
            return self._inflated[1]

    async def _part(self, k: int, offset: int, dest: memoryview) -> None:
        stored = self.entry.ranges[k]
        if stored.codec is not None:  # checked whole as it is decompressed
            dest[:] = (await self._raw(k))[offset : offset + len(dest)]
            parts = self.parts.setdefault(k, [])
            parts.append((offset, len(dest), 0))
            if sum(n for _, n, _ in parts) == stored.nbytes:
                del self.parts[k]
            return
        async with self.limit:
            try:
                got = await self.storage.read_into(stored.object, stored.offset + offset, dest)
            except FileNotFoundError as exc:
                raise CorruptCheckpointError(f"{self.where}: data object {stored.object!r} is missing") from exc
        if got < len(dest):
            raise TruncatedObjectError(
                f"{self.where}: data object {stored.object!r} ends before the bytes of {self.entry.path!r}"
            )
        crc = await asyncio.to_thread(crc32c_of, dest) if stored.crc32c is not None else 0
        parts = self.parts.setdefault(k, [])
        parts.append((offset, len(dest), crc))
        if sum(n for _, n, _ in parts) == stored.nbytes:
            self._check(k, stored, sorted(parts))
            del self.parts[k]

    def _check(self, k: int, stored: ByteRange, parts: list[tuple[int, int, int]]) -> None:
        if stored.crc32c is None:
            return
        crc = 0
        for _, size, part_crc in parts:
            crc = crc32c_combine(crc, part_crc, size)
        if crc != stored.crc32c:
            raise ChecksumMismatchError(
                f"{self.where}: checksum mismatch in {self.entry.path!r} (object {stored.object!r}, offset "
                f"{stored.offset}): crc32c {crc:#010x}, manifest says {stored.crc32c:#010x}"
            )

    def finish(self) -> None:
        """Every stored range was read whole (else the export would skip bytes)."""
        if self.parts:
            raise CorruptCheckpointError(f"{self.where}: {self.entry.path!r} was not read whole")


class ShardedCursor:
    """Serves the bytes of a sharded entry's full tensor (see the module). Its window is a
    slab borrowed from ``slabs`` while the entry is read (a row larger than a slab: memory of
    its own)."""

    def __init__(
        self,
        storage: Storage,
        entry: EntryRecord,
        where: str,
        limit: asyncio.Semaphore,
        window_bytes: int,
        slabs: StagingSlabs | None = None,
    ) -> None:
        self.slabs = slabs
        self.storage = storage
        self.entry = entry
        self.where = where
        self.limit = limit
        self.dtype = torch_dtype(entry.dtype)
        shape = entry.shape
        self.row_bytes = math.prod(shape[1:]) * self.dtype.itemsize if shape else self.dtype.itemsize
        self.rows = shape[0] if shape else 1
        self.rows_per_window = max(1, window_bytes // max(1, self.row_bytes))
        self.window: torch.Tensor | None = None
        self.first_row = 0
        self.manifest = stub_manifest([entry])  # what the resharding reads look at
        self._memory: torch.Tensor | None = None  # the window's bytes
        self._slab: int | None = None

    async def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._memory is None or self._memory.numel() < nbytes:
            self._give_back()
            if self.slabs is not None and nbytes <= self.slabs.slab_bytes:
                self._slab, self._memory = await self.slabs.acquire()
            else:
                self._memory = torch.empty(nbytes, dtype=torch.uint8)
        return self._memory[:nbytes]

    def _give_back(self) -> None:
        if self._slab is not None and self.slabs is not None:
            self.slabs.release(self._slab)
        self._slab, self._memory, self.window = None, None, None

    async def _load(self, row: int) -> None:
        last = min(self.rows, row + self.rows_per_window)
        shape = tuple(self.entry.shape)
        box_shape = (last - row, *shape[1:]) if shape else ()
        memory = await self._buffer((last - row) * self.row_bytes)
        window = memory.view(self.dtype).view(box_shape) if box_shape else memory.view(self.dtype).view(())
        offsets = (row, *(0,) * (len(shape) - 1)) if shape else ()
        target = ShardTarget(window, offsets, box_shape, window)
        pieces = overlaps(self.manifest, {0: target})
        await read_into_targets(self.storage, self.where, pieces, self.limit, self.slabs)
        self.window, self.first_row = window, row

    async def serve(self, start: int, end: int, dest: memoryview) -> None:
        """Bytes ``[start, end)`` of the full tensor into ``dest`` (requests in order)."""
        position = start
        while position < end:
            row = position // self.row_bytes
            window = self.window
            held = 0 if window is None else (window.shape[0] if window.dim() else 1)
            if window is None or not self.first_row <= row < self.first_row + held:
                await self._load(row)
                window = self.window
            assert window is not None
            source = bytes_view(window)
            at = position - self.first_row * self.row_bytes
            take = min(end - position, len(source) - at)
            dest[position - start : position - start + take] = source[at : at + take]
            position += take
        if end >= self.rows * self.row_bytes:
            self._give_back()  # the last bytes were served: the slab goes back now, not at the export's end

    def finish(self) -> None:
        self._give_back()


Cursor = PlainCursor | ShardedCursor


def cursor_for(
    storage: Storage,
    entry: EntryRecord,
    where: str,
    limit: asyncio.Semaphore,
    window_bytes: int,
    slabs: StagingSlabs | None = None,
) -> Cursor:
    """A cursor over ``entry``'s full bytes (``slabs``: where a sharded one stages the stored
    ranges it copies from)."""
    if entry.kind == "sharded":
        return ShardedCursor(storage, entry, where, limit, window_bytes, slabs)
    return PlainCursor(storage, entry, where, limit)
