"""Capture stage: copy the state's bytes into reusable staging buffers under the RAM budget.

The coroutines run on the background loop thread; the copies themselves run on one
dedicated copier thread (torch releases the GIL while copying, so training threads and
the loop keep going). CUDA tensors are copied on a dedicated stream, ordered after the
work the caller had queued when ``save()`` was called, into pinned host buffers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..budget import ByteBudget
from ..tensorio import bytes_view, copy_range_into
from .plan import Chunk, SavePlan

if TYPE_CHECKING:
    from .spool import SpoolSession

__all__ = ["BufferPool", "Copier", "CudaOrder", "StagedChunk", "capture_chunks"]


class BufferPool:
    """Staging slabs of ``slab_bytes`` each, all of them together within ``budget``.

    A slab stays allocated (and touched) when released, ready for the next chunk or the
    next save: allocation and first touch, not the copy, dominate staging cost. Every
    allocated slab is counted in the budget, in use or idle. Loop thread only.
    """

    def __init__(self, budget: ByteBudget, slab_bytes: int, pin_memory: bool = False) -> None:
        if slab_bytes > budget.capacity:
            raise ValueError(f"slab of {slab_bytes} bytes exceeds {budget.name} ({budget.capacity})")
        self.budget = budget
        self.slab_bytes = slab_bytes
        self.pin_memory = pin_memory
        self._idle: asyncio.Queue[torch.Tensor] = asyncio.Queue()

    async def acquire(self) -> torch.Tensor:
        """A slab, waiting (FIFO) for one to be released when the budget is exhausted."""
        if self._idle.empty() and self.budget.try_acquire(self.slab_bytes):
            try:
                return torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=self.pin_memory)
            except BaseException:
                self.budget.release(self.slab_bytes)
                raise
        return await self._idle.get()

    def would_wait(self) -> bool:
        """True when :meth:`acquire` cannot be served at once."""
        return self._idle.empty() and self.budget.used + self.slab_bytes > self.budget.capacity

    def release(self, slab: torch.Tensor) -> None:
        """Hand a slab back for reuse."""
        self._idle.put_nowait(slab)

    def trim(self) -> None:
        """Free every idle slab (their bytes go back to the budget)."""
        while not self._idle.empty():
            self._idle.get_nowait()
            self.budget.release(self.slab_bytes)


@dataclass
class StagedChunk:
    """A captured chunk: plain bytes plus a small descriptor (no Python object graph)."""

    index: int
    object_name: str
    data: memoryview
    ranges: list[tuple[int, int]]  # (offset, nbytes) of each piece, for checksums
    release: Callable[[], None] = field(repr=False)
    spool_path: str | None = None  # set when the bytes are on the spool disk, not in ``data``
    chunk_crc: int | None = None  # crc32c of the whole spooled chunk (checked before upload)
    piece_crcs: list[int] | None = None  # crc32c of each range, known for spooled chunks


@dataclass
class CudaOrder:
    """Where the caller's CUDA work stood at save(): one event per device, recorded on
    the caller's current stream, so copies wait for the values the caller meant."""

    events: dict[torch.device, torch.cuda.Event]

    @classmethod
    def record(cls, plan: SavePlan) -> CudaOrder | None:
        """Runs on the caller's thread inside save()."""
        devices = {e.tensor.device for e in plan.entries if e.tensor.device.type == "cuda"}
        if not devices:
            return None
        events = {}
        for device in devices:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(device))
            events[device] = event
        return cls(events)


class _SlabLease:
    """Gives one slab back to its pool, once, however often it is called."""

    def __init__(self, pool: BufferPool, slab: torch.Tensor) -> None:
        self._pool = pool
        self._slab: torch.Tensor | None = slab

    def __call__(self) -> None:
        if self._slab is not None:
            self._pool.release(self._slab)
            self._slab = None


class Copier:
    """Runs on the copier thread: fills one slab with one chunk's pieces."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return self._streams[device]

    def copy(self, plan: SavePlan, chunk: Chunk, slab: torch.Tensor, order: CudaOrder | None) -> None:
        used: set[torch.device] = set()
        with torch.no_grad():
            for piece in chunk.pieces:
                src = plan.entries[piece.entry].tensor
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


async def capture_chunks(
    plan: SavePlan,
    pool: BufferPool,
    queue: asyncio.Queue[StagedChunk | None],
    executor: concurrent.futures.Executor,
    copier: Copier,
    order: CudaOrder | None,
    uploads_may_start: asyncio.Event,
    spool: SpoolSession | None = None,
) -> None:
    """Copy every chunk of ``plan`` into a slab and queue it for upload (loop thread).

    While RAM (or spool disk) has room, uploads are held back (``uploads_may_start`` unset)
    so that the copies and spills, which block training, get the CPU, memory and disk
    bandwidth to themselves; the event is set as soon as capture would have to wait for RAM
    or spool disk (otherwise the caller sets it once ``save()`` may return).
    """
    loop = asyncio.get_running_loop()
    for chunk in plan.chunks:
        if spool is not None and spool.wants(pool):
            if spool.disk_would_wait(chunk.nbytes):
                uploads_may_start.set()  # only landed chunks free spool disk

            async def copy_into(buffer: torch.Tensor, chunk: Chunk = chunk) -> None:
                await loop.run_in_executor(executor, copier.copy, plan, chunk, buffer, order)

            spooled = await spool.capture(chunk, copy_into)
            if spooled is not None:
                await queue.put(spooled)
                continue
        if pool.would_wait():
            uploads_may_start.set()
        slab = await pool.acquire()
        try:
            await loop.run_in_executor(executor, copier.copy, plan, chunk, slab, order)
        except BaseException:
            # Cancelled mid-copy, the copier thread may still be writing into the slab; the
            # executor has one thread, so any later copy into it is queued behind this one.
            pool.release(slab)
            raise
        release = _SlabLease(pool, slab)
        staged = StagedChunk(
            index=chunk.index,
            object_name=chunk.object_name,
            data=bytes_view(slab)[: chunk.nbytes],
            ranges=[(p.dst_offset, p.nbytes) for p in chunk.pieces],
            release=release,
        )
        try:
            await queue.put(staged)
        except BaseException:
            release()
            raise
