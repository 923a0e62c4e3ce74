"""Capture stage: copy the state's bytes into the staging arena's slabs, under the RAM budget.

The coroutines run on the background loop thread; the copies themselves run on one
dedicated copier thread (torch releases the GIL while copying, so training threads and
the loop keep going). CUDA tensors are copied on a dedicated stream, ordered after the
work the caller had queued when ``save()`` was called, into the (pinned) arena. Each
captured chunk is handed on as a descriptor (:mod:`aiosnap.handoff.contract`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from ctypes import memmove

import torch

from ..core.cudaorder import CudaOrder
from ..core.tensorio import copy_range_into, host_address, storage_holds, write_constants
from ..errors import UnsupportedStateError
from ..handoff.contract import SlabChunk, Staged
from .chunks import Chunk, SavePlan
from .slabs import SlabPool
from .spool import SpoolSession

__all__ = ["Copier", "capture_chunks"]


DIRECT_COPY_MAX = 1 << 20
"""Pieces up to this size whose bytes lie plainly in host memory are copied with one
``memmove`` each: a torch copy costs ~10 us of Python and dispatch per piece, which at tens
of thousands of small tensors is most of what ``save()`` blocks for. Larger pieces go
through torch, whose copies run on several threads."""


class Copier:
    """Runs on the copier thread: fills one slab with one chunk's pieces."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return self._streams[device]

    def warm_up(self) -> None:
        """One tiny copy through the same path, so the first save does not pay for the
        thread's start and torch's first dispatch of these ops (copier thread)."""
        with torch.no_grad():
            copy_range_into(torch.empty(64, dtype=torch.uint8), 0, torch.ones(16), 0, 64)

    def copy(self, plan: SavePlan, chunk: Chunk, slab: torch.Tensor, order: CudaOrder | None) -> None:
        if not (slab.device.type == "cpu" and slab.dtype == torch.uint8 and slab.is_contiguous()):
            raise ValueError("capture copies into a contiguous host uint8 buffer")
        if chunk.nbytes > slab.numel():
            raise ValueError(f"chunk {chunk.index} ({chunk.nbytes} bytes) does not fit its {slab.numel()}-byte slab")
        base = slab.data_ptr()
        entries = plan.entries
        used: set[torch.device] = set()
        with torch.no_grad():
            for piece in chunk.pieces:
                src = entries[piece.entry].tensor
                if piece.nbytes <= DIRECT_COPY_MAX:
                    address = host_address(src, piece.src_offset + piece.nbytes)
                    if address:
                        memmove(base + piece.dst_offset, address + piece.src_offset, piece.nbytes)
                        continue
                if not storage_holds(src):  # a copy would read memory that is not the tensor's
                    raise UnsupportedStateError(
                        f"{entries[piece.entry].path}: its storage holds fewer bytes than its view reaches "
                        "(resized smaller with untyped_storage().resize_()?); nothing was saved"
                    )
                if src.device.type == "cuda" and order is not None:
                    stream = self._stream(src.device)
                    if src.device not in used:
                        stream.wait_event(order.events[src.device])
                        used.add(src.device)
                    with torch.cuda.stream(stream):
                        copy_range_into(slab, piece.dst_offset, src, piece.src_offset, piece.nbytes, non_blocking=True)
                else:
                    copy_range_into(slab, piece.dst_offset, src, piece.src_offset, piece.nbytes)
        for device in used:
            self._streams[device].synchronize()
        if chunk.constants:
            write_constants(slab, chunk.constants)


async def capture_chunks(
    plan: SavePlan,
    pool: SlabPool,
    executor: concurrent.futures.Executor,
    copier: Copier,
    order: CudaOrder | None,
    stage: Callable[[Staged], None],
    may_upload: Callable[[], None],
    spool: SpoolSession | None = None,
) -> None:
    """Copy every chunk of ``plan`` into a slab (or the spool) and ``stage`` its descriptor
    for the transfer side (loop thread).

    While RAM (or spool disk) has room, uploads are held back so that the copies and spills,
    which block training, get the CPU, memory and disk bandwidth to themselves;
    ``may_upload`` is called as soon as capture would have to wait for RAM or spool disk
    (otherwise the caller lets uploads start once ``save()`` may return).
    """
    loop = asyncio.get_running_loop()
    save_id = plan.save_id

    def fill(chunk: Chunk, buffer: torch.Tensor) -> None:  # copier thread
        pool.ready_for(buffer)  # pinned: the slab is registered with CUDA before device copies into it
        copier.copy(plan, chunk, buffer, order)

    for chunk in plan.chunks:
        if spool is not None and spool.wants():
            if spool.disk_would_wait(chunk.nbytes):
                may_upload()  # only landed chunks free spool disk

            async def copy_into(buffer: torch.Tensor, chunk: Chunk = chunk) -> None:
                await loop.run_in_executor(executor, fill, chunk, buffer)

            spooled = await spool.capture(chunk, copy_into)
            if spooled is not None:
                stage(spooled)
                continue
        if pool.would_wait():
            may_upload()
        slab = await pool.acquire()
        try:
            await loop.run_in_executor(executor, fill, chunk, pool.tensor(slab))
        except BaseException:
            # Cancelled mid-copy, the copier thread may still be writing into the slab; the
            # executor has one thread, so any later copy into it is queued behind this one.
            pool.release(slab)
            raise
        stage(SlabChunk(save_id, chunk.index, slab, chunk.nbytes))
