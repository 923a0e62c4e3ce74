"""Upload stage: write staged chunks to storage, checksum them, free their RAM.

Workers run on the background loop thread; checksums run in the default executor
(the crc32c package releases the GIL) so the loop stays responsive.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from ..checksums import crc32c_of, file_crc32c
from ..errors import ChecksumMismatchError
from ..format.manifest import Checksums
from ..storage.base import Storage
from ..trainer.capture import StagedChunk

__all__ = ["UploadClock", "upload_worker"]


class UploadClock(Protocol):
    def began(self) -> None: ...
    def landed(self) -> None: ...


def _range_checksums(staged: StagedChunk) -> list[int]:
    return [crc32c_of(staged.data[offset : offset + nbytes]) for offset, nbytes in staged.ranges]


async def _upload_spooled(storage: Storage, staged: StagedChunk) -> list[int]:
    """Upload a chunk from its spool file after checking the file's crc32c."""
    assert staged.spool_path is not None
    assert staged.piece_crcs is not None
    found = await asyncio.to_thread(file_crc32c, staged.spool_path)
    if found != staged.chunk_crc:
        raise ChecksumMismatchError(
            f"spool file {staged.spool_path} is corrupt (crc32c {found:#010x}, written {staged.chunk_crc:#010x}); "
            f"not committing {staged.object_name}"
        )
    await storage.write_file(staged.object_name, staged.spool_path)
    return staged.piece_crcs


async def upload_worker(
    queue: asyncio.Queue[StagedChunk | None],
    storage: Storage,
    crcs: Checksums,
    may_start: asyncio.Event,
    on_landed: Callable[[StagedChunk, list[int]], Awaitable[None]] | None = None,
    clock: UploadClock | None = None,
) -> None:
    """Take chunks off ``queue`` until a ``None`` arrives; each chunk's RAM (or spool disk)
    is released in finally, after ``on_landed`` (the spool journal) has run.

    Starts only once ``may_start`` is set (capture has priority while RAM lasts). ``clock``
    hears when the first chunk is taken and when each one has landed."""
    await may_start.wait()
    while True:
        staged = await queue.get()
        if staged is None:
            return
        if clock is not None:
            clock.began()
        try:
            if staged.spool_path is not None:
                checksums = await _upload_spooled(storage, staged)
            else:
                checksums = await asyncio.to_thread(_range_checksums, staged)
                await storage.write(staged.object_name, staged.data)
            for (offset, _), crc in zip(staged.ranges, checksums, strict=True):
                crcs[(staged.object_name, offset)] = crc
            if on_landed is not None:
                await on_landed(staged, checksums)
            if clock is not None:
                clock.landed()
        finally:
            staged.release()
