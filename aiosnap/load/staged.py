"""Loads through staging slabs: entries whose target cannot take a direct read.

A CUDA tensor or a strided view (of the saved dtype and shape) cannot receive a file's
bytes directly. Their ranges are read, a slab
at a time, into the checkpointer's staging slabs (the same RAM budget as saves; pinned
when CUDA is in use), each range's crc32c is checked, and the verified bytes are copied
into the target: on a dedicated CUDA stream per device (ordered after the work the caller
had queued when ``load()`` was called), or by torch on a worker thread for host targets.
Slabs go back once their copies are done, so reads of the next slabs overlap the copies
of the last ones, and host memory never holds more than the budget: no second copy of a
GPU model in RAM.

Planning (:func:`stage_batches`) and the reads run on the loop thread; the copies on
worker threads.
"""

from __future__ import annotations

import asyncio
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..core.aio import complete_before_cancel, run_all
from ..core.cudaorder import CudaOrder
from ..core.tensorio import bytes_view, copyable, iter_row_major_views
from ..format.manifest import ByteRange, Manifest
from .decode import torch_dtype
from .fetch_runs import Range, read_in_turn

__all__ = ["SlabBatch", "StagingSlabs", "read_staged", "stage_batches", "stageable"]

ALIGN = 64
"""Where each range starts in a slab: a multiple of this (dtype views of the slab)."""


class StagingSlabs(Protocol):
    """Slabs of the RAM budget lent to a load (loop thread)."""

    slab_bytes: int

    async def acquire(self) -> tuple[int, torch.Tensor]:
        """A free slab: its id and its memory as a uint8 tensor, waiting (FIFO) for one."""
        ...

    def release(self, slab: int) -> None: ...


@dataclass(frozen=True)
class _Slot:
    """One stored range of entry ``entry``: bytes ``[at, at + range.nbytes)`` of the entry,
    staged at ``offset`` of the slab."""

    entry: int
    where: ByteRange
    at: int
    offset: int


@dataclass
class SlabBatch:
    """Ranges that fit one slab together."""

    slots: list[_Slot] = field(default_factory=list)
    nbytes: int = 0


def stage_batches(manifest: Manifest, staged: dict[int, torch.Tensor], slab_bytes: int) -> list[SlabBatch]:
    """Pack the ranges of the ``staged`` entries into slab-sized batches, in storage order
    (neighbouring ranges land in one batch: one coalesced read). The caller has checked
    (:func:`stageable`) that every range fits a slab and holds whole elements."""
    slots = sorted(
        ((index, r, at) for index in staged for r, at in _ranges_with_offsets(manifest, index)),
        key=lambda item: (item[1].object, item[1].offset),
    )
    batches: list[SlabBatch] = []
    batch = SlabBatch()
    for index, r, at in slots:
        offset = -(-batch.nbytes // ALIGN) * ALIGN
        if batch.slots and offset + r.nbytes > slab_bytes:
            batches.append(batch)
            batch, offset = SlabBatch(), 0
        batch.slots.append(_Slot(index, r, at, offset))
        batch.nbytes = offset + r.nbytes
    if batch.slots:
        batches.append(batch)
    return batches


def _ranges_with_offsets(manifest: Manifest, index: int) -> list[tuple[ByteRange, int]]:
    found, at = [], 0
    for r in manifest.entries[index].ranges:
        found.append((r, at))
        at += r.nbytes
    return found


def stageable(manifest: Manifest, index: int, slab_bytes: int) -> bool:
    """Whether entry ``index`` can be staged: every range fits a slab and starts and ends
    on an element (a forged manifest may cut elements; such an entry is read whole)."""
    entry = manifest.entries[index]
    itemsize = torch_dtype(entry.dtype).itemsize
    return all(r.nbytes <= slab_bytes and r.nbytes % itemsize == 0 for r in entry.ranges)


def _copy_out(
    manifest: Manifest,
    batch: SlabBatch,
    slab: torch.Tensor,
    staged: dict[int, torch.Tensor],
    streams: dict[torch.device, Any],
    caller: CudaOrder | None,
) -> None:
    """Worker thread: copy each verified range from the slab into its target's elements;
    CUDA copies are queued on the device's copy stream, then waited for."""
    used: set[torch.device] = set()
    try:
        with torch.no_grad():
            for slot in batch.slots:
                _copy_slot(manifest, slot, slab, staged[slot.entry], streams, caller, used)
    finally:
        for device in used:
            streams[device].synchronize()  # even after a failed copy: the slab is reused once this returns


def _copy_slot(
    manifest: Manifest,
    slot: _Slot,
    slab: torch.Tensor,
    target: torch.Tensor,
    streams: dict[torch.device, Any],
    caller: CudaOrder | None,
    used: set[torch.device],
) -> None:
    target = copyable(target)  # the same dtype as the entry's (or both as bytes)
    dtype = target.dtype
    source = slab[slot.offset : slot.offset + slot.where.nbytes].view(dtype)
    first = slot.at // dtype.itemsize
    cuda = target.device.type == "cuda"
    if cuda:
        stream = streams[target.device]
        if target.device not in used:
            used.add(target.device)
            if caller is not None and target.device in caller.events:
                stream.wait_event(caller.events[target.device])
        context: Any = torch.cuda.stream(stream)
    else:
        context = nullcontext()
    with context:
        position = 0
        for view in iter_row_major_views(target, first, first + source.numel()):
            count = view.numel()
            view.copy_(source[position : position + count].view(view.shape), non_blocking=cuda)
            position += count


async def read_staged(
    storage: Any,
    where: str,
    manifest: Manifest,
    staged: dict[int, torch.Tensor],
    slabs: StagingSlabs,
    limit: asyncio.Semaphore,
    caller: CudaOrder | None = None,
) -> None:
    """Loop thread: read every range of the ``staged`` entries through slabs into their
    targets, verified before any byte reaches a target."""
    streams: dict[torch.device, Any] = {}
    for target in staged.values():
        if target.device.type == "cuda" and target.device not in streams:
            streams[target.device] = torch.cuda.Stream(target.device)  # type: ignore[no-untyped-call]

    async def one(batch: SlabBatch) -> None:
        slab_id, slab = await slabs.acquire()
        try:
            view = bytes_view(slab)
            ranges = [
                Range(manifest.entries[s.entry].path, s.where, view[s.offset : s.offset + s.where.nbytes])
                for s in batch.slots
            ]
            await read_in_turn(storage, where, ranges, limit)  # checks every range's crc32c
            # a copy under way finishes before a cancellation goes on: the slab is then free
            await complete_before_cancel(asyncio.to_thread(_copy_out, manifest, batch, slab, staged, streams, caller))
        finally:
            slabs.release(slab_id)  # reads into it ended too (storage reads finish before a cancel)

    await run_all(one(batch) for batch in stage_batches(manifest, staged, slabs.slab_bytes))
