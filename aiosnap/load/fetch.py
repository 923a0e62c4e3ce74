"""Load-side I/O: read every byte range of a manifest into fresh tensors and verify it.

Runs on the background loop thread; neighbouring ranges of one object are read with one
request (one ``preadv`` on local disk, one ranged GET on S3) scattered straight into their
tensors' memory; runs are read concurrently (``upload.concurrency``) and each range's
crc32c is checked in a worker thread. Nothing of the caller's state is touched here: the tensors are new, so a corrupt
checkpoint is refused before any object is modified.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from ..checksums import crc32c_of
from ..errors import AiosnapError, ChecksumMismatchError, CorruptCheckpointError, TruncatedObjectError, first_error
from ..format.manifest import ByteRange, Manifest
from ..storage.base import Storage
from ..tensorio import bytes_view
from .decode import torch_dtype

__all__ = ["ReadPlan", "fetch_entries", "naming_targets"]


@dataclass(frozen=True)
class ReadPlan:
    """What a load reads: the entries ``only`` (None: all of them), and the entries read
    straight into the caller's tensors ``into`` (see :mod:`aiosnap.load.inplace`)."""

    only: set[int] | None = None
    into: dict[int, torch.Tensor] = field(default_factory=dict)


def _empty_for(manifest: Manifest, index: int) -> torch.Tensor:
    entry = manifest.entries[index]
    try:
        if entry.kind == "pickle":
            return torch.empty(entry.nbytes, dtype=torch.uint8)
        return torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
    except RuntimeError as exc:  # cannot allocate: refuse the checkpoint, not crash the caller
        raise CorruptCheckpointError(f"step {manifest.step}: cannot allocate {entry.path!r}: {exc}") from exc


MAX_GAP = 4096
"""Ranges of one object at most this many bytes apart are read with one request (the gap's
bytes are read and dropped): pieces in a chunk are 64-byte aligned, so neighbours are
never more than 63 bytes apart."""
MAX_RUN_BYTES = 64 * 1024**2
"""A coalesced read never spans more than this (reads of one object still go in parallel)."""


@dataclass(frozen=True)
class _Range:
    path: str
    where: ByteRange
    dest: memoryview


@dataclass
class _Run:
    """Neighbouring ranges of one object, read with one request."""

    object: str
    ranges: list[_Range] = field(default_factory=list)

    @property
    def start(self) -> int:
        return self.ranges[0].where.offset

    @property
    def end(self) -> int:
        last = self.ranges[-1].where
        return last.offset + last.nbytes


def plan_runs(ranges: list[_Range]) -> list[_Run]:
    """Group ranges into runs: by object, in offset order, neighbours at most
    :data:`MAX_GAP` apart, each run at most :data:`MAX_RUN_BYTES` long (or one range)."""
    by_object: dict[str, list[_Range]] = {}
    for r in ranges:
        by_object.setdefault(r.where.object, []).append(r)
    runs: list[_Run] = []
    for name, found in by_object.items():
        found.sort(key=lambda r: r.where.offset)
        run: _Run | None = None
        for r in found:
            offset = r.where.offset
            if run is None or offset - run.end > MAX_GAP or offset + r.where.nbytes - run.start > MAX_RUN_BYTES:
                run = _Run(name)
                runs.append(run)
            run.ranges.append(r)
    return runs


def _verify(where: str, run: _Run) -> None:
    """Worker thread: every range's crc32c against the manifest."""
    for r in run.ranges:
        crc = crc32c_of(r.dest)
        if crc != r.where.crc32c:
            raise ChecksumMismatchError(
                f"{where}: checksum mismatch in {r.path!r} (object {r.where.object!r}, offset {r.where.offset}): "
                f"crc32c {crc:#010x}, manifest says {r.where.crc32c:#010x}"
            )


async def _read_run(storage: Storage, where: str, run: _Run, limit: asyncio.Semaphore) -> None:
    buffers: list[memoryview] = []
    position = run.start
    for r in run.ranges:  # ranges never overlap (the manifest is checked for that)
        if r.where.offset > position:
            buffers.append(memoryview(bytearray(r.where.offset - position)))  # a gap: read, dropped
        buffers.append(r.dest)
        position = r.where.offset + r.where.nbytes
    async with limit:
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
        await asyncio.to_thread(_verify, where, run)


async def check_object_sizes(
    storage: Storage, manifest: Manifest, concurrency: int, names: set[str] | None = None
) -> None:
    """Every data object (of ``names``, when given) is there with the size the manifest
    gives, before anything is allocated for it (a hostile manifest cannot make a load
    allocate more than is stored)."""
    where = f"{storage.url} step {manifest.step}"
    limit = asyncio.Semaphore(concurrency)

    async def check(name: str, nbytes: int) -> None:
        async with limit:
            try:
                size = await storage.size(name)
            except FileNotFoundError as exc:
                raise CorruptCheckpointError(f"{where}: data object {name!r} is missing") from exc
        if size < nbytes:
            raise TruncatedObjectError(f"{where}: data object {name!r} is truncated: {size} of {nbytes} bytes")

    try:
        async with asyncio.TaskGroup() as group:
            for obj in manifest.objects:
                if names is None or obj.name in names:
                    group.create_task(check(obj.name, obj.nbytes))
    except BaseExceptionGroup as group_error:
        raise (leaf := first_error(group_error)) from leaf.__cause__


async def fetch_entries(
    storage: Storage, manifest: Manifest, concurrency: int, plan: ReadPlan | None = None
) -> dict[int, torch.Tensor]:
    """Every entry of ``manifest`` (those of ``plan.only``: a partial load reads nothing
    else), verified: read into the caller's tensor ``plan.into[index]`` where there is one,
    else into a new CPU tensor (pickles as uint8 bytes). Neighbouring ranges of an object
    are read with one request (:func:`plan_runs`); each range's crc32c is checked on its
    own. If a read or a check fails after in-place reads began, the error names the
    caller's tensors that may now hold partly loaded bytes."""
    plan = plan or ReadPlan()
    where = f"{storage.url} step {manifest.step}"
    wanted = [(i, e) for i, e in enumerate(manifest.entries) if plan.only is None or i in plan.only]
    names = None if plan.only is None else {r.object for _, e in wanted for r in e.ranges}
    await check_object_sizes(storage, manifest, concurrency, names)
    tensors: dict[int, torch.Tensor] = {}
    ranges: list[_Range] = []
    for index, entry in wanted:
        tensor = plan.into.get(index)
        if tensor is None:
            tensor = _empty_for(manifest, index)
        tensors[index] = tensor
        view = bytes_view(tensor)
        position = 0
        for r in entry.ranges:
            ranges.append(_Range(entry.path, r, view[position : position + r.nbytes]))
            position += r.nbytes
    limit = asyncio.Semaphore(concurrency)
    try:
        async with asyncio.TaskGroup() as group:
            for run in plan_runs(ranges):
                group.create_task(_read_run(storage, where, run, limit))
    except BaseExceptionGroup as group_error:
        leaf = first_error(group_error)
        if plan.into:
            raise naming_targets(leaf, [manifest.entries[i].path for i in plan.into]) from leaf.__cause__
        raise leaf from leaf.__cause__
    return tensors


def naming_targets(error: BaseException, paths: list[str]) -> BaseException:
    """``error``, saying which of the caller's tensors were being loaded in place."""
    shown = ", ".join(repr(p) for p in paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")
    note = (
        f"the load wrote in place: {shown} may now hold partly loaded data (load again, or use "
        "load(..., atomic=True) to change nothing unless everything verifies)"
    )
    if isinstance(error, AiosnapError):
        return type(error)(f"{error}; {note}")
    error.add_note(note)
    return error
