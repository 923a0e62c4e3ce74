"""Uploading one staged chunk: write it to storage and say where each byte range landed.

Runs on the transfer side's loop; checksums run on worker threads (the crc32c package
releases the GIL). Each byte is checksummed once: one pass over a slab yields the CRC32C of
every tensor's range and, combined, those of the object or S3 parts it goes out as; a
slab's bytes go to storage as a memoryview of the arena (no copy in Python). A spooled
chunk is checked against the CRC32C it was written with by the storage as it sends it.

A slab is handed back only when nothing reads it any more: a request abandoned mid-body
(a timeout, a cancelled save) can leave its bytes in a closing connection's write buffer
for a moment, and the slab must not be refilled under it (:class:`~aiosnap.core.arena.SlabLease`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Sequence

from ..core.aio import drop_frame_locals, finish_despite_cancel
from ..core.arena import Arena, SlabLease
from ..core.budget import ByteBudget
from ..format.placement import Landing
from ..format.spec import ChunkSpec
from ..handoff.contract import FileChunk, SlabChunk, Staged
from ..storage.base import Storage
from .dedup import land_file, land_slab
from .readback import CheckedReuse

__all__ = ["LEASE_WAIT_S", "upload_chunk"]

log = logging.getLogger("aiosnap")

LEASE_WAIT_S = 1.0
"""How long an upload waits for the views of its slab to go. A failed request's writer
task ends within a few loop turns (aiohttp aborts the connection, dropping what it had
queued); what holds a view after that is a Python reference that sends nothing (a log
record kept by a handler, say), and the slab is reused."""


async def _until_released(lease: SlabLease, what: str) -> None:
    """Wait until nothing reads the slab (a failed request's writer task ends within a few
    loop turns; one held in a reference cycle of the failure goes at a garbage collection,
    forced here: failures only), bounded by :data:`LEASE_WAIT_S`."""
    waited = 0.0
    collected = False
    while lease.in_use and waited < LEASE_WAIT_S:
        if waited >= 0.05 and not collected:
            gc.collect()
            collected = True
            continue
        await asyncio.sleep(0.01)
        waited += 0.01
    if lease.in_use:
        log.debug("aiosnap: the body of %s is still referenced after %g s; reusing its slab", what, waited)


async def upload_chunk(
    storage: Storage,
    arena: Arena,
    staged: Staged,
    chunk: ChunkSpec,
    reuse: CheckedReuse | None = None,
    itemsizes: Sequence[int] | None = None,
    scratch: ByteBudget | None = None,
) -> Landing:
    """Write ``staged`` (chunk ``chunk`` of its save) to storage: where each piece landed,
    with its crc32c (and, with ``reuse``, its digest: pieces equal to a base range are not
    written; with ``itemsizes``, each piece's dtype item size, pieces are compressed where
    that makes them smaller, packed in RAM reserved from ``scratch``: see :mod:`.dedup`)."""
    if isinstance(staged, FileChunk):
        digests = list(staged.digests) if staged.digests else [None] * len(chunk.pieces)
        return await land_file(
            storage, staged.path, staged.crc, chunk, staged.pieces, digests, reuse, itemsizes, scratch
        )
    assert isinstance(staged, SlabChunk)
    lease = arena.lease(staged.slab, staged.nbytes)
    try:
        assert lease.view is not None
        return await land_slab(storage, lease.view, chunk, reuse, itemsizes, scratch)
    except BaseException as error:
        drop_frame_locals(error)  # its traceback would keep the request body (the slab) alive
        raise
    finally:
        lease.release()
        if lease.in_use:
            await finish_despite_cancel(_until_released(lease, chunk.object_name))
