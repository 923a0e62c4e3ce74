"""Coalesced, verified reads of byte ranges (loop thread): the load's I/O primitive.

Neighbouring ranges of one object are read with one request (one ``preadv`` on local disk,
one ranged GET on S3) scattered straight into their destinations; each range's crc32c is
then checked on its own, in a worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..core.aio import complete_before_cancel
from ..core.checksums import crc32c_of
from ..core.codec import decompress_into
from ..errors import ChecksumMismatchError, CorruptCheckpointError, TruncatedObjectError
from ..format.manifest import ByteRange
from ..storage.base import Storage

__all__ = ["MAX_GAP", "MAX_RUN_BYTES", "Range", "Run", "back_to_back", "plan_runs", "read_in_turn", "read_run"]


MAX_GAP = 4096
"""Ranges of one object at most this many bytes apart are read with one request (the gap's
bytes are read and dropped): pieces in a chunk are 64-byte aligned, so neighbours are
never more than 63 bytes apart."""
MAX_RUN_BYTES = 64 * 1024**2
"""A coalesced read never spans more than this (reads of one object still go in parallel)."""


@dataclass(frozen=True)
class Range:
    path: str
    where: ByteRange
    dest: memoryview


@dataclass
class Run:
    """Neighbouring ranges of one object, read with one request."""

    object: str
    ranges: list[Range] = field(default_factory=list)

    @property
    def start(self) -> int:
        return self.ranges[0].where.offset

    @property
    def end(self) -> int:
        last = self.ranges[-1].where
        return last.offset + last.extent


def back_to_back(path: str, stored: Iterable[ByteRange], buffer: memoryview) -> list[Range]:
    """``stored`` ranges (of the entry at ``path``, in order) read one after the other into
    ``buffer`` from its start."""
    found, at = [], 0
    for r in stored:
        found.append(Range(path, r, buffer[at : at + r.nbytes]))
        at += r.nbytes
    return found


def plan_runs(ranges: list[Range]) -> list[Run]:
    """Group ranges into runs: by object, in offset order, neighbours at most
    :data:`MAX_GAP` apart, each run at most :data:`MAX_RUN_BYTES` long (or one range)."""
    by_object: dict[str, list[Range]] = {}
    for r in ranges:
        by_object.setdefault(r.where.object, []).append(r)
    runs: list[Run] = []
    for name, found in by_object.items():
        found.sort(key=lambda r: r.where.offset)
        run: Run | None = None
        for r in found:
            offset = r.where.offset
            if r.where.codec is not None:  # a compressed range is read on its own, decompressed
                runs.append(Run(name, [r]))
                run = None
                continue
            if run is None or offset - run.end > MAX_GAP or offset + r.where.nbytes - run.start > MAX_RUN_BYTES:
                run = Run(name)
                runs.append(run)
            run.ranges.append(r)
    return runs


def _verify(where: str, run: Run) -> None:
    """Worker thread: every range's crc32c against the manifest (an unverified range of a
    translated manifest, crc32c None, has none to check)."""
    for r in run.ranges:
        if r.where.crc32c is None:
            continue
        crc = crc32c_of(r.dest)
        if crc != r.where.crc32c:
            raise ChecksumMismatchError(
                f"{where}: checksum mismatch in {r.path!r} (object {r.where.object!r}, offset {r.where.offset}): "
                f"crc32c {crc:#010x}, manifest says {r.where.crc32c:#010x}"
            )


def _inflate(where: str, r: Range, frame: memoryview) -> None:
    """Worker thread: check the stored frame of the compressed range ``r``, decompress it
    into its destination (never more than its size), check the raw bytes."""
    crc = crc32c_of(frame)
    if crc != r.where.stored_crc32c:
        raise ChecksumMismatchError(
            f"{where}: checksum mismatch in the compressed bytes of {r.path!r} (object {r.where.object!r}, offset "
            f"{r.where.offset}): crc32c {crc:#010x}, manifest says {r.where.stored_crc32c:#010x}"
        )
    try:
        decompress_into(frame, r.dest, r.where.shuffle or 1)
    except ValueError as exc:
        raise CorruptCheckpointError(
            f"{where}: the compressed bytes of {r.path!r} (object {r.where.object!r}, offset {r.where.offset}) "
            f"do not decompress to its {r.where.nbytes} bytes: {exc}"
        ) from None
    _verify(where, Run(r.where.object, [r]))


async def _read_compressed(storage: Storage, where: str, r: Range) -> None:
    """Read the frame of one compressed range into a scratch buffer of its stored size
    (smaller than the range: the manifest says so), then decompress it into place."""
    frame = memoryview(bytearray(r.where.extent))
    try:
        got = await storage.read_into(r.where.object, r.where.offset, frame)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{where}: data object {r.where.object!r} of {r.path!r} is missing") from exc
    if got < frame.nbytes:
        raise TruncatedObjectError(
            f"{where}: data object {r.where.object!r} is truncated: {r.path!r} needs {frame.nbytes} stored bytes "
            f"at offset {r.where.offset}, only {got} there"
        )
    await complete_before_cancel(asyncio.to_thread(_inflate, where, r, frame))


async def read_run(storage: Storage, where: str, run: Run) -> None:
    """Read ``run`` with one request into its ranges' destinations and verify each range
    (a compressed range: its frame, decompressed into its destination)."""
    if run.ranges[0].where.codec is not None:
        await _read_compressed(storage, where, run.ranges[0])
        return
    buffers: list[memoryview] = []
    position = run.start
    for r in run.ranges:  # ranges never overlap (the manifest is checked for that)
        if r.where.offset > position:
            buffers.append(memoryview(bytearray(r.where.offset - position)))  # a gap: read, dropped
        buffers.append(r.dest)
        position = r.where.offset + r.where.nbytes
    try:
        got = await storage.read_scatter(run.object, run.start, buffers)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(
            f"{where}: data object {run.object!r} of {run.ranges[0].path!r} is missing"
        ) from exc
    if got < run.end - run.start:
        short = next(r for r in run.ranges if r.where.offset + r.where.nbytes > run.start + got)
        raise TruncatedObjectError(
            f"{where}: data object {run.object!r} is truncated: {short.path!r} needs {short.where.nbytes} "
            f"bytes at offset {short.where.offset}, only {max(0, run.start + got - short.where.offset)} there"
        )
    # a check under way finishes before a cancellation goes on (it reads the destinations,
    # which may be slabs lent out again at once)
    await complete_before_cancel(asyncio.to_thread(_verify, where, run))


async def read_in_turn(storage: Storage, where: str, ranges: list[Range], limit: asyncio.Semaphore | None) -> None:
    """Read ``ranges`` run after run (each with one request, each range verified), taking a
    permit of ``limit`` for each request (None: the caller holds one already)."""
    for run in plan_runs(ranges):
        if limit is None:
            await read_run(storage, where, run)
        else:
            async with limit:
                await read_run(storage, where, run)
