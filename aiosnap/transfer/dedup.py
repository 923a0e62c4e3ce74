"""Incremental saves on the transfer side: land each chunk writing only its new pieces.

A piece whose captured bytes (xxh3-128 digest, size and crc32c) equal a range of the base
step (see :class:`~aiosnap.format.placement.Reuse`), and whose stored bytes are known to
hold them (:mod:`.readback`), is not uploaded: the manifest names the base's range. The
chunk's object then holds only the new pieces, packed in plan order at :data:`PIECE_ALIGN`;
a chunk with nothing new writes no object. Decided per piece, never
per chunk, and never on tensor version counters or addresses: on the bytes as captured.

Runs on the transfer side's loop; hashing and packing run on worker threads (crc32c and
xxhash release the GIL). A slab is never written: another reader may see it (on preemption
the trainer side writes the slabs it lent to the spool, and its journal records the bytes
at the plan's offsets). The new pieces (compressed where that is smaller) are packed into
a buffer of their size, reserved from the transfer side's share of the RAM budget without
waiting (``scratch``); a spooled chunk's new pieces are read from its file into such a
buffer (the spool file stays intact for a resume). When the share has no room, the chunk
lands whole, as planned: no references, no compression (correct, only less saved).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from ..core.budget import ByteBudget
from ..core.checksums import RangeChecksums, content_digest, crc32c_of
from ..core.codec import SCRATCH_BYTES, compress_into
from ..errors import ChecksumMismatchError
from ..format.placement import Landing, Placed, Reference
from ..format.spec import ChunkSpec
from ..storage.base import Storage
from .readback import CheckedReuse

__all__ = ["PIECE_ALIGN", "hash_slab", "land_file", "land_slab", "whole_landing"]

log = logging.getLogger("aiosnap")

PIECE_ALIGN = 64
"""Alignment of each piece inside a packed object (the plan's own, ``trainer.chunks.ALIGN``)."""


def _boundaries(offsets: Sequence[tuple[int, int]]) -> list[int]:
    return [b for offset, nbytes in offsets for b in (offset, offset + nbytes)]


def hash_slab(data: memoryview, chunk: ChunkSpec, digests: bool) -> tuple[RangeChecksums, list[str | None]]:
    """Worker thread: the crc32c segments of ``data`` and the digest of each piece (None
    each when ``digests`` is False)."""
    checksums = RangeChecksums(data, _boundaries([(p.dst_offset, p.nbytes) for p in chunk.pieces]))
    found = [content_digest(data[p.dst_offset : p.dst_offset + p.nbytes]) if digests else None for p in chunk.pieces]
    return checksums, found


def whole_landing(
    chunk: ChunkSpec, crcs: Sequence[int], digests: Sequence[str | None], *, incremental: bool
) -> Landing:
    """Every piece written where the plan put it."""
    pieces = tuple(
        Placed(chunk.object_name, p.dst_offset, crc, digest)
        for p, crc, digest in zip(chunk.pieces, crcs, digests, strict=True)
    )
    return Landing(chunk.nbytes, pieces, incremental=incremental)


async def _decide(
    chunk: ChunkSpec, crcs: Sequence[int], digests: Sequence[str | None], reuse: CheckedReuse
) -> tuple[list[Placed | None], list[Reference]]:
    """Per piece, the base range that holds its bytes, known good (None: a new piece)."""
    reused: list[Placed | None] = []
    references: list[Reference] = []
    for piece, crc, digest in zip(chunk.pieces, crcs, digests, strict=True):
        found = None if digest is None else await reuse.take(piece.nbytes, digest, crc)
        if found is None:
            reused.append(None)
            continue
        reused.append(found[0])
        references.append(found[1])
    return reused, references


Packed = tuple[int, int | None, int | None, int | None]
"""Where a new piece went in its packed object: (offset, stored size, crc32c of the stored
frame, shuffle), the last three None when stored raw."""


def _landing(
    chunk: ChunkSpec,
    crcs: Sequence[int],
    digests: Sequence[str | None],
    reused: Sequence[Placed | None],
    packed: Sequence[Packed | None],
    stored: int,
    references: Sequence[Reference],
) -> Landing:
    pieces = []
    for crc, digest, found, place in zip(crcs, digests, reused, packed, strict=True):
        if found is not None:
            pieces.append(found)
        else:
            assert place is not None
            pieces.append(Placed(chunk.object_name, place[0], crc, digest, *place[1:]))
    return Landing(stored, tuple(pieces), tuple(dict.fromkeys(references)), incremental=True)


def _written(reuse: CheckedReuse | None, chunk: ChunkSpec, landing: Landing) -> Landing:
    """``landing``, its own pieces (written and checksummed here) recorded as known good."""
    if reuse is not None:
        reuse.wrote(chunk, landing)
    return landing


def _packed_size(new: Sequence[tuple[int, int, int | None]]) -> int:
    """Room for the ``new`` pieces (index, size, item size) one after the other, each at the
    next :data:`PIECE_ALIGN` boundary."""
    cursor = 0
    for _, nbytes, _ in new:
        cursor = -(-(cursor + nbytes) // PIECE_ALIGN) * PIECE_ALIGN
    return cursor


def _scratch_size(new: Sequence[tuple[int, int, int | None]]) -> int:
    """What packing ``new`` holds at once: its packed room, and the codec's scratch when
    any piece is compressed."""
    compressed = [nbytes for _, nbytes, itemsize in new if itemsize is not None]
    return _packed_size(new) + min(SCRATCH_BYTES, max(compressed, default=0))


@asynccontextmanager
async def _reserved(scratch: ByteBudget | None, nbytes: int, what: str) -> AsyncIterator[bool]:
    """Hold ``nbytes`` of ``scratch`` for the block if it has room now (True), else False."""
    if nbytes and (scratch is None or nbytes > scratch.capacity or not scratch.try_acquire(nbytes)):
        log.debug("aiosnap: no RAM for packing %s (%d bytes): it lands whole, raw", what, nbytes)
        yield False
        return
    try:
        yield True
    finally:
        if nbytes:
            assert scratch is not None
            scratch.release(nbytes)


def _pack(
    data: memoryview, sources: Sequence[tuple[int, int, int | None]], out: memoryview
) -> tuple[list[Packed], int]:
    """Worker thread: pack the pieces of ``data`` at ``sources`` (offset, size, item size to
    compress by, or None: stored raw), in order, each at the next :data:`PIECE_ALIGN`
    boundary of ``out`` (``data`` is only read): compressed (zstd, shuffled by the item
    size) when that is smaller, else copied. The alignment gaps are zeroed. Returns where
    each went and the packed size."""
    cursor = end = 0
    found: list[Packed] = []
    for offset, nbytes, itemsize in sources:
        raw = data[offset : offset + nbytes]
        out[end:cursor] = bytes(cursor - end)
        room = out[cursor : cursor + nbytes]
        size = None if itemsize is None else compress_into(raw, room, itemsize)
        if size is not None and itemsize is not None:
            found.append((cursor, size, crc32c_of(room[:size]), itemsize if itemsize > 1 else None))
            end = cursor + size
        else:
            room[:] = raw
            found.append((cursor, None, None, None))
            end = cursor + nbytes
        cursor = -(-end // PIECE_ALIGN) * PIECE_ALIGN
    return found, end


def _new_pieces(
    chunk: ChunkSpec, reused: Sequence[Placed | None], itemsizes: Sequence[int] | None
) -> list[tuple[int, int, int | None]]:
    """Indices of the pieces to write, in offset order, with the item size to compress by."""
    order = sorted((i for i, found in enumerate(reused) if found is None), key=lambda i: chunk.pieces[i].dst_offset)
    return [(i, chunk.pieces[i].nbytes, None if itemsizes is None else itemsizes[i]) for i in order]


async def _write_packed(
    storage: Storage, chunk: ChunkSpec, data: memoryview, offsets: Sequence[int], new: list[tuple[int, int, int | None]]
) -> tuple[list[Packed | None], int]:
    """Pack the ``new`` pieces (index, size, item size), each at ``offsets[index]`` of
    ``data``, into a buffer of their packed size (its room reserved by the caller), and
    write it as the chunk's object (none when nothing is new)."""
    packed: list[Packed | None] = [None] * len(chunk.pieces)
    if not new:
        return packed, 0
    out = memoryview(bytearray(_packed_size(new)))
    places, stored = await asyncio.to_thread(_pack, data, [(offsets[i], n, k) for i, n, k in new], out)
    for (index, _, _), place in zip(new, places, strict=True):
        packed[index] = place
    extents = [(p[0], p[1] or chunk.pieces[i].nbytes) for i, p in enumerate(packed) if p is not None]
    checksums = await asyncio.to_thread(RangeChecksums, out[:stored], _boundaries(extents))
    try:
        await storage.write_checksummed(chunk.object_name, out[:stored], checksums)
    finally:
        checksums.release()
    return packed, stored


async def land_slab(
    storage: Storage, data: memoryview, chunk: ChunkSpec, reuse: CheckedReuse | None,
    itemsizes: Sequence[int] | None = None, scratch: ByteBudget | None = None,
) -> Landing:  # fmt: skip
    """Upload the staged slab bytes ``data`` of ``chunk`` (never written to): all of it as
    planned, or (with ``reuse``) only its new pieces, and (with ``itemsizes``, each piece's
    dtype item size) each compressed where that makes it smaller; packed in RAM reserved
    from ``scratch`` (whole when it has no room)."""
    checksums, digests = await asyncio.to_thread(hash_slab, data, chunk, reuse is not None)
    try:
        crcs = [checksums.of(p.dst_offset, p.dst_offset + p.nbytes) for p in chunk.pieces]
        reused, references = ([None] * len(crcs), []) if reuse is None else await _decide(chunk, crcs, digests, reuse)
        new = _new_pieces(chunk, reused, itemsizes)
        packs = bool(references) or itemsizes is not None
        async with _reserved(scratch, _scratch_size(new) if packs else 0, chunk.object_name) as room:
            if not (packs and room):
                await storage.write_checksummed(chunk.object_name, data, checksums)
                return _written(reuse, chunk, whole_landing(chunk, crcs, digests, incremental=reuse is not None))
            checksums.release()
            packed, stored = await _write_packed(storage, chunk, data, [p.dst_offset for p in chunk.pieces], new)
    finally:
        checksums.release()
    return _written(reuse, chunk, _landing(chunk, crcs, digests, reused, packed, stored, references))


def _read_pieces(
    path: str, chunk: ChunkSpec, new: list[tuple[int, int, int | None]], crcs: Sequence[int]
) -> tuple[bytearray, list[int]]:
    """Worker thread: the ``new`` pieces of spool file ``path`` read one after the other
    (each at the next :data:`PIECE_ALIGN` boundary), each checked against the crc32c it
    was spooled with; and where each one is."""
    offsets = [0] * len(chunk.pieces)
    cursor = 0
    for index, nbytes, _ in new:
        offsets[index] = cursor
        cursor = -(-(cursor + nbytes) // PIECE_ALIGN) * PIECE_ALIGN
    out = bytearray(cursor)
    view = memoryview(out)
    with open(path, "rb") as f:
        for index, nbytes, _ in new:
            piece, at = chunk.pieces[index], offsets[index]
            f.seek(piece.dst_offset)
            got = f.readinto(view[at : at + nbytes])
            if got != nbytes or crc32c_of(view[at : at + nbytes]) != crcs[index]:
                raise ChecksumMismatchError(
                    f"spool file {path}: the piece at {piece.dst_offset} does not match its spooled crc32c"
                )
    return out, offsets


async def land_file(
    storage: Storage, path: str, crc: int, chunk: ChunkSpec, crcs: Sequence[int], digests: Sequence[str | None],
    reuse: CheckedReuse | None, itemsizes: Sequence[int] | None = None, scratch: ByteBudget | None = None,
) -> Landing:  # fmt: skip
    """Upload the spooled chunk in ``path`` (crc32c ``crc``; its pieces' ``crcs`` and
    ``digests`` as spooled): the whole file, or (with ``reuse``) its new pieces, and (with
    ``itemsizes``) each compressed where that makes it smaller. The new pieces are read into
    a buffer of their size, and packed into another, both reserved from ``scratch`` (the
    whole file when it has no room; the spool file stays as it is, for a resume)."""
    known = all(d is not None for d in digests)
    reused: list[Placed | None] = [None] * len(crcs)
    references: list[Reference] = []
    if reuse is not None and known:
        reused, references = await _decide(chunk, crcs, digests, reuse)
    new = _new_pieces(chunk, reused, itemsizes)
    packs = bool(references) or itemsizes is not None
    need = _packed_size(new) + _scratch_size(new) if packs else 0  # the pieces read, and packed
    async with _reserved(scratch, need, chunk.object_name) as room:
        if not (packs and room):
            await storage.write_file_verified(chunk.object_name, path, crc)
            return _written(reuse, chunk, whole_landing(chunk, crcs, digests, incremental=reuse is not None))
        buffer, offsets = await asyncio.to_thread(_read_pieces, path, chunk, new, crcs)
        packed, stored = await _write_packed(storage, chunk, memoryview(buffer), offsets, new)
    return _written(reuse, chunk, _landing(chunk, crcs, digests, reused, packed, stored, references))
