"""The export's streaming copy: a sink's layout filled from the source, a slab at a time.

A sink (:mod:`aiosnap.interop.convert.sinks`) lays its output out as :class:`DestObject`\\ s,
each a sequence of segments: constant bytes (headers, pickles, directories) and
:class:`Slice`\\ s of selected entries' full bytes. :func:`stream` cuts each object into
pieces of at most a slab, fills each piece in a slab of the RAM budget (constants copied,
entry bytes read by the entry's cursor straight into the slab: :mod:`.cursors`), takes one
crc32c pass over it (every segment's crc32c from it: :class:`~aiosnap.core.checksums.RangeChecksums`)
and hands it to the sink, whose writes run while the next piece fills. So the export never
holds more than the budget (one slab of it is kept for assembling sharded tensors), however
large the checkpoint. Coroutines on the export's loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ...core.aio import run_all
from ...core.arena import SlabLease
from ...core.checksums import RangeChecksums
from ...format.manifest import EntryRecord
from ...storage.base import Storage
from ..dcp.runtime import SlabPool
from .cursors import Cursor, cursor_for

__all__ = ["DestObject", "Piece", "Segment", "Sink", "Slice", "stream"]


@dataclass(frozen=True)
class Slice:
    """Bytes ``[start, start + nbytes)`` of selected entry ``entry``'s full row-major bytes."""

    entry: int
    start: int
    nbytes: int


Segment = bytes | Slice


@dataclass
class DestObject:
    """One object (file) of the sink's output: its segments in order."""

    name: str
    segments: list[Segment] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(len(s) if isinstance(s, bytes) else s.nbytes for s in self.segments)


@dataclass(frozen=True)
class Piece:
    """Bytes ``[offset, offset + len(data))`` of ``obj``, filled; ``checksums`` answers the
    crc32c of any of its segments (their ends are its segment boundaries)."""

    obj: DestObject
    offset: int
    data: memoryview
    checksums: RangeChecksums


class Sink(Protocol):
    """Where an export goes: a layout of objects, then their pieces, then the commit."""

    url: str

    async def put(self, piece: Piece) -> None:
        """Write one piece (pieces of one object come in order; up to ``concurrency`` at once)."""
        ...

    async def commit(self) -> None:
        """Every piece is written: make the output exist (its metadata last)."""
        ...

    async def abort(self) -> None:
        """The export failed: remove what it wrote."""
        ...


class PoolSlabs:
    """The export's slab pool lent to the resharding reads of a sharded entry
    (:class:`~aiosnap.load.staged.StagingSlabs`): stored ranges are staged in the budget too."""

    def __init__(self, pool: SlabPool) -> None:
        self.pool = pool
        self.slab_bytes = pool.slab_bytes

    async def acquire(self) -> tuple[int, torch.Tensor]:
        slab = await self.pool.acquire()
        return slab, torch.frombuffer(self.pool.view(slab), dtype=torch.uint8)

    def release(self, slab: int) -> None:
        self.pool.release(slab)


def _pieces(obj: DestObject, size: int) -> Iterator[tuple[int, list[Segment]]]:
    """``obj`` cut into pieces of at most ``size`` bytes: (offset, segments)."""
    offset, filled = 0, 0
    current: list[Segment] = []
    for segment in obj.segments:
        length = len(segment) if isinstance(segment, bytes) else segment.nbytes
        done = 0
        while done < length:
            take = min(length - done, size - filled)
            if isinstance(segment, bytes):
                current.append(segment[done : done + take])
            else:
                current.append(Slice(segment.entry, segment.start + done, take))
            done += take
            filled += take
            if filled == size:
                yield offset, current
                offset, current, filled = offset + size, [], 0
    if current or offset == 0:
        yield offset, current


async def stream(
    source: Storage,
    entries: list[EntryRecord],
    objects: list[DestObject],
    sink: Sink,
    pool: SlabPool,
    *,
    concurrency: int,
    where: str,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Fill and hand over every object of the layout (see the module)."""
    limit = asyncio.Semaphore(concurrency)
    slabs = PoolSlabs(pool)
    cursors: dict[int, Cursor] = {}
    writes: list[asyncio.Task[None]] = []
    window = pool.slab_bytes
    try:
        for obj in objects:
            for offset, segments in _pieces(obj, pool.slab_bytes):
                slab = await pool.acquire()
                try:
                    size = sum(len(s) if isinstance(s, bytes) else s.nbytes for s in segments)
                    view = pool.view(slab, size)
                    cuts = await _fill(source, entries, cursors, segments, view, where, limit, window, slabs)
                    checksums = await asyncio.to_thread(RangeChecksums, view, cuts)
                    lease = pool.lease(slab, size)
                except BaseException:
                    pool.release(slab)
                    raise
                failed = [w for w in writes if w.done() and not w.cancelled() and w.exception() is not None]
                if failed:
                    await failed[0]  # raises the write's error, with its type
                writes = [w for w in writes if not w.done()]
                assert lease.view is not None
                piece = Piece(obj, offset, lease.view, checksums)
                writes.append(asyncio.create_task(_put(sink, piece, pool, slab, lease, progress)))
                while len(running := [w for w in writes if not w.done()]) >= concurrency:
                    await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        await run_all(_wait(w) for w in writes)
        for cursor in cursors.values():
            cursor.finish()
    except BaseException:
        for w in writes:
            w.cancel()
        await asyncio.gather(*writes, return_exceptions=True)
        raise


async def _wait(task: asyncio.Task[None]) -> None:
    await task


async def _put(
    sink: Sink, piece: Piece, pool: SlabPool, slab: int, lease: SlabLease, progress: Callable[[int], None] | None
) -> None:
    try:
        await sink.put(piece)
    finally:
        pool.release(slab, lease)
    if progress is not None:
        progress(len(piece.data))


async def _fill(
    source: Storage,
    entries: list[EntryRecord],
    cursors: dict[int, Cursor],
    segments: list[Segment],
    view: memoryview,
    where: str,
    limit: asyncio.Semaphore,
    window: int,
    slabs: PoolSlabs,
) -> list[int]:
    """Put ``segments`` into ``view``; the segment boundaries."""
    cuts = []
    position = 0
    for segment in segments:
        if isinstance(segment, bytes):
            view[position : position + len(segment)] = segment
            length = len(segment)
        else:
            cursor = cursors.get(segment.entry)
            if cursor is None:
                entry = entries[segment.entry]
                cursor = cursors[segment.entry] = cursor_for(source, entry, where, limit, window, slabs)
            length = segment.nbytes
            await cursor.serve(segment.start, segment.start + length, view[position : position + length])
        cuts += [position, position + length]
        position += length
    return cuts
