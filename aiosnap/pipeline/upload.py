"""Upload stage: write staged chunks to storage, checksum them, free their RAM.

Workers run on the background loop thread; checksums run in the default executor
(the crc32c package releases the GIL) so the loop stays responsive.
"""

from __future__ import annotations

import asyncio

import crc32c

from ..manifest import Checksums
from ..storage.base import Storage
from .capture import StagedChunk

__all__ = ["crc32c_of", "upload_worker"]


def crc32c_of(data: memoryview) -> int:
    """CRC32C (Castagnoli) of ``data``; runs on whichever thread calls it."""
    return int(crc32c.crc32c(data))


def _range_checksums(staged: StagedChunk) -> list[int]:
    return [crc32c_of(staged.data[offset : offset + nbytes]) for offset, nbytes in staged.ranges]


async def upload_worker(
    queue: asyncio.Queue[StagedChunk | None],
    storage: Storage,
    crcs: Checksums,
    may_start: asyncio.Event,
) -> None:
    """Take chunks off ``queue`` until a ``None`` arrives; each slab is released in finally.

    Starts only once ``may_start`` is set (capture has priority while RAM lasts)."""
    await may_start.wait()
    while True:
        staged = await queue.get()
        if staged is None:
            return
        try:
            checksums = await asyncio.to_thread(_range_checksums, staged)
            await storage.write(staged.object_name, staged.data)
            for (offset, _), crc in zip(staged.ranges, checksums, strict=True):
                crcs[(staged.object_name, offset)] = crc
        finally:
            staged.release()
