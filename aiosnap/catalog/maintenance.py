"""Looking after a checkpoint root without training code: list, verify, copy.

Everything here is async and runs on whichever event loop calls it (the CLI runs its own
with ``asyncio.run``); it talks to a :class:`~aiosnap.storage.base.Storage` directly and
never holds more than ``concurrency`` byte ranges in memory at once. It reads a root that
training may be writing at the same time: a step removed between listing and reading is
skipped, and one step whose manifest cannot be read is shown as such, never failing the
whole listing. Garbage collection lives in :mod:`aiosnap.catalog.garbage`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from ..core.checksums import crc32c_of
from ..core.names import attempt_of_object, check_object_name, check_save_id, parse_step_dir
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    first_error,
)
from ..format.manifest import DataObject, Manifest, Span
from ..storage.base import Storage
from .keep import KeptNames
from .steps import committed_steps, read_manifest

__all__ = ["ReferencedStep", "StepInfo", "list_steps", "referenced_steps", "split_name", "verify_step"]

log = logging.getLogger("aiosnap")
Progress = Callable[[int], None]
VERIFY_WINDOW = 8 * 1024 * 1024
"""Bytes read and checksummed at a time per concurrent range in :func:`verify_step`."""


State = Literal["committed", "incomplete", "unreadable", "referenced"]


@dataclass(frozen=True)
class StepInfo:
    """One step folder: committed (has a readable manifest), unreadable (has a manifest
    this aiosnap cannot use), incomplete (a save in progress, failed or interrupted), or
    referenced (a deleted step whose objects later committed steps still name: they stay
    until the last of those goes)."""

    step: int
    state: State
    nbytes: int
    """Bytes in storage (a committed step's data objects)."""
    time: float
    """Commit time (committed) or newest object's modification time (incomplete)."""
    world_size: int | None = None
    save_id: str | None = None
    entries: int | None = None
    leftovers: list[str] = field(default_factory=list)
    """Attempt folders beside the committed one (failed or in-progress re-saves)."""
    problem: str | None = None
    """Why an unreadable step's manifest cannot be used."""
    referenced_bytes: int | None = None
    """Of a committed step: the bytes its manifest's ranges name (what a load reads; less than
    ``nbytes`` by the copies of values several ranks wrote that it does not use)."""
    own_bytes: int | None = None
    """Of a committed step: the bytes of its own objects (``nbytes`` less what it references
    of earlier saves: what deleting it alone could free)."""


def split_name(name: str) -> tuple[int, str | None] | None:
    """(step, save id or None) of an object name aiosnap could have written, else None:
    ``<step>/manifest.json`` and the like give (step, None), ``<step>/<save id>/...``
    gives (step, save id); anything else in a root is not aiosnap's."""
    parts = name.split("/")
    step = parse_step_dir(parts[0])
    if step is None or len(parts) < 2:
        return None
    try:
        check_object_name(name)  # no empty, '.' or '..' parts, nothing odd
    except ValueError:
        return None
    if len(parts) == 2:
        return step, None
    try:
        return step, check_save_id(parts[1])
    except ValueError:
        return None


async def list_steps(storage: Storage, *, include_incomplete: bool = False) -> list[StepInfo]:
    """Committed steps (ascending) with time, size, world size; with
    ``include_incomplete`` also folders without a manifest and leftover attempts."""
    await storage.check_root()
    committed = await committed_steps(storage)
    read = await asyncio.gather(*(read_manifest(storage, s) for s in committed), return_exceptions=True)
    infos: dict[int, StepInfo] = {}
    for step, found in zip(committed, read, strict=True):
        if isinstance(found, CheckpointNotFoundError):
            continue  # removed (retention, gc) since the listing
        if isinstance(found, CorruptCheckpointError):
            infos[step] = StepInfo(step=step, state="unreadable", nbytes=0, time=0.0, problem=str(found))
        elif isinstance(found, BaseException):
            raise found
        else:
            infos[step] = StepInfo(
                step=step,
                state="committed",
                nbytes=found.total_bytes,
                referenced_bytes=found.referenced_bytes,
                own_bytes=found.own_bytes,
                time=found.created_at,
                world_size=found.world_size,
                save_id=found.save_id,
                entries=len(found.entries),
            )
    if include_incomplete:
        named = KeptNames(o.name for m in read if isinstance(m, Manifest) for o in m.stored_objects())
        for step, found in zip(committed, read, strict=True):
            if isinstance(found, CorruptCheckpointError):
                named.hold_through(step)  # what deletions keep for an unreadable step (see .keep)
        attempts: dict[int, dict[str, list[float]]] = {}
        sizes: dict[int, int] = {}
        unnamed: set[int] = set()
        for obj in await storage.walk():
            where = split_name(obj.name)
            if where is None:
                continue
            step, save_id = where
            if save_id is None:
                continue
            attempts.setdefault(step, {}).setdefault(save_id, []).append(obj.mtime)
            sizes[step] = sizes.get(step, 0) + obj.size
            if obj.name not in named:
                unnamed.add(step)
        for step, found_attempts in attempts.items():
            if step in infos:
                leftovers = sorted(a for a in found_attempts if a != infos[step].save_id)
                infos[step] = replace(infos[step], leftovers=leftovers)
            else:
                newest = max(t for times in found_attempts.values() for t in times)
                state: State = "incomplete" if step in unnamed else "referenced"
                infos[step] = StepInfo(
                    step=step, state=state, nbytes=sizes[step], time=newest, leftovers=sorted(found_attempts)
                )
    return [infos[s] for s in sorted(infos)]


async def verify_step(
    storage: Storage, manifest: Manifest, *, concurrency: int = 8, progress: Progress | None = None
) -> list[str]:
    """Read every byte range of ``manifest`` and check its crc32c, those in objects of
    earlier saves it references too (each of which must exist with its size, in a step
    folder that exists); returns the problems found (empty: the checkpoint is intact).
    ``progress`` hears bytes as they are checked. A range without a crc32c (a foreign
    checkpoint's) is read whole, which finds missing and truncated data, but not checked.
    The storage's :meth:`~aiosnap.storage.base.Storage.integrity_spans` are checked too."""
    where = f"{storage.url} step {manifest.step}"
    limit = asyncio.Semaphore(concurrency)
    problems: list[str] = []

    async def check(path: str, r: Span) -> None:
        async with limit:  # at most ``concurrency`` windows of VERIFY_WINDOW bytes in memory
            buffer = memoryview(bytearray(min(r.nbytes, VERIFY_WINDOW)))
            crc, done = 0, 0
            while done < r.nbytes:
                window = buffer[: min(len(buffer), r.nbytes - done)]
                try:
                    got = await storage.read_into(r.object, r.offset + done, window)
                except FileNotFoundError:
                    problems.append(f"{path}: data object {r.object!r} is missing")
                    return
                crc = await asyncio.to_thread(crc32c_of, window[:got], crc)
                done += got
                if progress is not None:
                    progress(got)
                if got < len(window):
                    problems.append(
                        f"{path}: {r.object!r} is truncated ({done} of {r.nbytes} bytes at offset {r.offset})"
                    )
                    return
        if r.crc32c is not None and crc != r.crc32c:  # None: unverified (a foreign format's range)
            problems.append(
                f"{path}: checksum mismatch in {r.object!r} at offset {r.offset} "
                f"(crc32c {crc:#010x}, manifest says {r.crc32c:#010x})"
            )

    try:
        async with asyncio.TaskGroup() as group:
            for obj in manifest.references or ():
                group.create_task(_check_reference(storage, obj, problems))
            for entry, r in manifest.all_ranges():  # shards and every rank's own values too
                group.create_task(check(entry.path, r))
            for what, r in await storage.integrity_spans(manifest.step):
                group.create_task(check(what, r))
    except BaseExceptionGroup as group_error:
        raise (leaf := first_error(group_error)) from leaf.__cause__
    return sorted(f"{where}: {p}" for p in problems)


async def _check_reference(storage: Storage, obj: DataObject, problems: list[str]) -> None:
    """A referenced object of an earlier save is there, whole: its step folder and attempt
    folder exist, and its size is the one the manifest gives (its ranges are checked like
    every other range)."""
    attempt = attempt_of_object(obj.name)
    assert attempt is not None  # the manifest's validation makes sure
    try:
        size = await storage.size(obj.name)
    except FileNotFoundError:
        folder, save_id = obj.name.split("/")[:2]
        if folder not in await storage.list_children(""):
            problems.append(f"references {obj.name!r} in step folder {folder}, which does not exist")
        elif save_id not in await storage.list_children(folder):
            problems.append(f"references {obj.name!r} of attempt {folder}/{save_id}, which does not exist")
        else:
            problems.append(f"referenced data object {obj.name!r} (of step {attempt[0]}) is missing")
        return
    if size != obj.nbytes:
        problems.append(
            f"referenced data object {obj.name!r} (of step {attempt[0]}) is {size} bytes, "
            f"the manifest says {obj.nbytes}"
        )


@dataclass(frozen=True)
class ReferencedStep:
    """What one step names of an earlier save's objects."""

    step: int
    save_id: str
    objects: int
    nbytes: int
    """The referenced objects' stored bytes."""
    range_bytes: int
    """The bytes the step's ranges read from them."""


def referenced_steps(manifest: Manifest) -> list[ReferencedStep]:
    """The earlier saves ``manifest`` references, by step (ascending)."""
    read: dict[str, int] = {}
    for _, r in manifest.all_ranges():
        read[r.object] = read.get(r.object, 0) + r.nbytes
    found: dict[tuple[int, str], list[DataObject]] = {}
    for obj in manifest.references or ():
        attempt = attempt_of_object(obj.name)
        assert attempt is not None  # the manifest's validation makes sure
        found.setdefault(attempt, []).append(obj)
    return [
        ReferencedStep(step, save_id, len(objs), sum(o.nbytes for o in objs), sum(read.get(o.name, 0) for o in objs))
        for (step, save_id), objs in sorted(found.items())
    ]
