"""Uploading one staged chunk: write it to storage and return the crc32c of its byte ranges.

Runs on the transfer side's loop; checksums run on worker threads (the crc32c package
releases the GIL). A slab's bytes go to storage as a memoryview of the arena (no copy in
Python); a spooled chunk streams from its file after its crc32c is checked against the one
it was written with.
"""

from __future__ import annotations

import asyncio

from ..arena import Arena
from ..checksums import crc32c_of, file_crc32c
from ..errors import ChecksumMismatchError
from ..format.spec import ChunkSpec
from ..staging import FileChunk, SlabChunk, Staged
from ..storage.base import Storage

__all__ = ["upload_chunk"]


def _range_checksums(data: memoryview, chunk: ChunkSpec) -> list[int]:
    return [crc32c_of(data[p.dst_offset : p.dst_offset + p.nbytes]) for p in chunk.pieces]


async def _upload_file(storage: Storage, staged: FileChunk, chunk: ChunkSpec) -> list[int]:
    found = await asyncio.to_thread(file_crc32c, staged.path)
    if found != staged.crc:
        raise ChecksumMismatchError(
            f"spool file {staged.path} is corrupt (crc32c {found:#010x}, written {staged.crc:#010x}); "
            f"not committing {chunk.object_name}"
        )
    await storage.write_file(chunk.object_name, staged.path)
    return list(staged.pieces)


async def upload_chunk(storage: Storage, arena: Arena, staged: Staged, chunk: ChunkSpec) -> list[int]:
    """Write ``staged`` (chunk ``chunk`` of its save) to storage; the crc32c of each piece."""
    if isinstance(staged, FileChunk):
        return await _upload_file(storage, staged, chunk)
    assert isinstance(staged, SlabChunk)
    data = arena.view(staged.slab, staged.nbytes)
    checksums = await asyncio.to_thread(_range_checksums, data, chunk)
    await storage.write(chunk.object_name, data)
    return checksums
