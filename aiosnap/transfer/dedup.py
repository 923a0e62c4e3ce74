"""Incremental saves on the transfer side: land each chunk writing only its new pieces.

A piece whose captured bytes (xxh3-128 digest, size and crc32c) equal a range of the base
step (see :class:`~aiosnap.format.placement.Reuse`) is not uploaded: the manifest names the
base's range. The chunk's object then holds only the new pieces, packed in plan order at
:data:`PIECE_ALIGN`; a chunk with nothing new writes no object. Decided per piece, never
per chunk, and never on tensor version counters or addresses: on the bytes as captured.

Runs on the transfer side's loop; hashing and packing run on worker threads (crc32c and
xxhash release the GIL). A slab is packed in place (every new piece moves towards the
slab's start, ``memoryview`` assignment is a memmove); a spooled chunk's new pieces are
read from its file into one buffer of their size (the spool file stays intact for a resume).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from ..core.checksums import RangeChecksums, content_digest, crc32c_of
from ..errors import ChecksumMismatchError
from ..format.placement import Landing, Placed, Reference, Reuse
from ..format.spec import ChunkSpec
from ..storage.base import Storage

__all__ = ["PIECE_ALIGN", "hash_slab", "land_file", "land_slab", "whole_landing"]

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


def _decide(
    chunk: ChunkSpec, crcs: Sequence[int], digests: Sequence[str | None], reuse: Reuse
) -> tuple[list[Placed | None], list[Reference]]:
    """Per piece, the base range that holds its bytes (None: a new piece)."""
    reused: list[Placed | None] = []
    references: list[Reference] = []
    for piece, crc, digest in zip(chunk.pieces, crcs, digests, strict=True):
        found = None if digest is None else reuse.take(piece.nbytes, digest, crc)
        if found is None:
            reused.append(None)
            continue
        reused.append(found[0])
        references.append(found[1])
    return reused, references


def _packed_offsets(chunk: ChunkSpec, reused: Sequence[Placed | None]) -> tuple[list[int | None], int]:
    """Where each new piece goes in the packed object (None: reused), in the order of the
    plan's offsets (so no piece moves past where it was), and the packed size."""
    cursor = end = 0
    offsets: list[int | None] = [None] * len(chunk.pieces)
    for index in sorted(range(len(chunk.pieces)), key=lambda i: chunk.pieces[i].dst_offset):
        if reused[index] is not None:
            continue
        offsets[index] = cursor
        end = cursor + chunk.pieces[index].nbytes
        cursor = -(-end // PIECE_ALIGN) * PIECE_ALIGN
    return offsets, end


def _landing(
    chunk: ChunkSpec,
    crcs: Sequence[int],
    digests: Sequence[str | None],
    reused: Sequence[Placed | None],
    packed: Sequence[int | None],
    stored: int,
    references: Sequence[Reference],
) -> Landing:
    pieces = []
    for crc, digest, found, offset in zip(crcs, digests, reused, packed, strict=True):
        if found is not None:
            pieces.append(found)
        else:
            assert offset is not None
            pieces.append(Placed(chunk.object_name, offset, crc, digest))
    return Landing(stored, tuple(pieces), tuple(dict.fromkeys(references)), incremental=True)


def _pack_in_place(data: memoryview, chunk: ChunkSpec, packed: Sequence[int | None], stored: int) -> RangeChecksums:
    """Worker thread: move each new piece to its packed offset (never past where it was:
    pieces are in plan order), zero the alignment gaps, checksum the packed bytes."""
    end = 0
    ranges = []
    for piece, offset in sorted(zip(chunk.pieces, packed, strict=True), key=lambda pair: pair[0].dst_offset):
        if offset is None:
            continue
        if offset > piece.dst_offset:
            raise AssertionError("packing moves pieces towards the start only")
        data[end:offset] = bytes(offset - end)
        if offset != piece.dst_offset:
            data[offset : offset + piece.nbytes] = data[piece.dst_offset : piece.dst_offset + piece.nbytes]
        end = offset + piece.nbytes
        ranges.append((offset, piece.nbytes))
    return RangeChecksums(data[:stored], _boundaries(ranges))


async def land_slab(storage: Storage, data: memoryview, chunk: ChunkSpec, reuse: Reuse | None) -> Landing:
    """Upload the staged slab bytes ``data`` of ``chunk``: all of it, or (with ``reuse``)
    only its new pieces."""
    checksums, digests = await asyncio.to_thread(hash_slab, data, chunk, reuse is not None)
    try:
        crcs = [checksums.of(p.dst_offset, p.dst_offset + p.nbytes) for p in chunk.pieces]
        if reuse is None:
            await storage.write_checksummed(chunk.object_name, data, checksums)
            return whole_landing(chunk, crcs, digests, incremental=False)
        reused, references = _decide(chunk, crcs, digests, reuse)
        if not references:
            await storage.write_checksummed(chunk.object_name, data, checksums)
            return whole_landing(chunk, crcs, digests, incremental=True)
        packed, stored = _packed_offsets(chunk, reused)
        if stored:
            checksums.release()
            checksums = await asyncio.to_thread(_pack_in_place, data, chunk, packed, stored)
            await storage.write_checksummed(chunk.object_name, data[:stored], checksums)
        return _landing(chunk, crcs, digests, reused, packed, stored, references)
    finally:
        checksums.release()


def _read_pieces(
    path: str, chunk: ChunkSpec, packed: Sequence[int | None], stored: int, crcs: Sequence[int]
) -> bytearray:
    """Worker thread: the new pieces of spool file ``path``, packed, each checked against
    the crc32c it was spooled with."""
    out = bytearray(stored)
    view = memoryview(out)
    with open(path, "rb") as f:
        for piece, offset, crc in zip(chunk.pieces, packed, crcs, strict=True):
            if offset is None:
                continue
            f.seek(piece.dst_offset)
            got = f.readinto(view[offset : offset + piece.nbytes])
            if got != piece.nbytes or crc32c_of(view[offset : offset + piece.nbytes]) != crc:
                raise ChecksumMismatchError(
                    f"spool file {path}: the piece at {piece.dst_offset} does not match its spooled crc32c"
                )
    return out


async def land_file(
    storage: Storage, path: str, crc: int, chunk: ChunkSpec, crcs: Sequence[int], digests: Sequence[str | None],
    reuse: Reuse | None,
) -> Landing:  # fmt: skip
    """Upload the spooled chunk in ``path`` (crc32c ``crc``; its pieces' ``crcs`` and
    ``digests`` as spooled): the whole file, or (with ``reuse``) its new pieces."""
    if reuse is not None and all(d is not None for d in digests):
        reused, references = _decide(chunk, crcs, digests, reuse)
        if references:
            packed, stored = _packed_offsets(chunk, reused)
            if stored:
                data = memoryview(await asyncio.to_thread(_read_pieces, path, chunk, packed, stored, crcs))
                ranges = [(o, p.nbytes) for o, p in zip(packed, chunk.pieces, strict=True) if o is not None]
                checksums = await asyncio.to_thread(RangeChecksums, data, _boundaries(ranges))
                await storage.write_checksummed(chunk.object_name, data, checksums)
            return _landing(chunk, crcs, digests, reused, packed, stored, references)
    await storage.write_file_verified(chunk.object_name, path, crc)
    return whole_landing(chunk, crcs, digests, incremental=reuse is not None)
