"""Looking after a checkpoint root without training code: list, verify, collect garbage.

Everything here is async and runs on whichever event loop calls it (the CLI runs its own
with ``asyncio.run``); it talks to a :class:`~aiosnap.storage.base.Storage` directly and
never holds more than ``concurrency`` byte ranges in memory at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from .catalog import committed_steps, read_manifest, remove_step
from .errors import ChecksumMismatchError, CorruptCheckpointError, TruncatedObjectError, first_error
from .manifest import MANIFEST_FILE, ByteRange, Manifest, manifest_name
from .names import step_dir
from .pipeline.commit import commit_manifest, remove_attempt
from .pipeline.upload import crc32c_of
from .storage.base import ObjectInfo, Storage

__all__ = ["GcReport", "StepInfo", "collect_garbage", "copy_step", "list_steps", "verify_step"]

Progress = Callable[[int], None]
VERIFY_WINDOW = 8 * 1024 * 1024
"""Bytes read and checksummed at a time per concurrent range in :func:`verify_step`."""


@dataclass(frozen=True)
class StepInfo:
    """One step folder: committed (has a manifest) or incomplete (a save in progress,
    failed or interrupted), or leftover attempts beside a committed step."""

    step: int
    state: Literal["committed", "incomplete"]
    nbytes: int
    time: float
    """Commit time (committed) or newest object's modification time (incomplete)."""
    world_size: int | None = None
    save_id: str | None = None
    entries: int | None = None
    leftovers: list[str] = field(default_factory=list)
    """Attempt folders beside the committed one (failed or in-progress re-saves)."""


def _by_step(objects: list[ObjectInfo]) -> dict[str, list[ObjectInfo]]:
    folders: dict[str, list[ObjectInfo]] = {}
    for obj in objects:
        top = obj.name.split("/", 1)[0]
        if top.isdigit():
            folders.setdefault(top, []).append(obj)
    return folders


async def list_steps(storage: Storage, *, include_incomplete: bool = False) -> list[StepInfo]:
    """Committed steps (ascending) with time, size, world size; with
    ``include_incomplete`` also folders without a manifest and leftover attempts."""
    committed = await committed_steps(storage)
    manifests = await asyncio.gather(*(read_manifest(storage, s) for s in committed))
    infos = {
        m.step: StepInfo(
            step=m.step,
            state="committed",
            nbytes=m.total_bytes,
            time=m.created_at,
            world_size=m.world_size,
            save_id=m.save_id,
            entries=len(m.entries),
        )
        for m in manifests
    }
    if include_incomplete:
        for folder, objects in _by_step(await storage.walk()).items():
            step = int(folder)
            attempts = sorted({o.name.split("/")[1] for o in objects if o.name.count("/") >= 2})
            if step in infos:
                leftovers = [a for a in attempts if a != infos[step].save_id]
                infos[step] = replace(infos[step], leftovers=leftovers)
            else:
                infos[step] = StepInfo(
                    step=step,
                    state="incomplete",
                    nbytes=sum(o.size for o in objects),
                    time=max(o.mtime for o in objects),
                    leftovers=attempts,
                )
    return [infos[s] for s in sorted(infos)]


async def verify_step(
    storage: Storage, manifest: Manifest, *, concurrency: int = 8, progress: Progress | None = None
) -> list[str]:
    """Read every byte range of ``manifest`` and check its crc32c; returns the problems
    found (empty: the checkpoint is intact). ``progress`` hears bytes as they are checked."""
    where = f"{storage.url} step {manifest.step}"
    limit = asyncio.Semaphore(concurrency)
    problems: list[str] = []

    async def check(path: str, r: ByteRange) -> None:
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
        if crc != r.crc32c:
            problems.append(
                f"{path}: checksum mismatch in {r.object!r} at offset {r.offset} "
                f"(crc32c {crc:#010x}, manifest says {r.crc32c:#010x})"
            )

    try:
        async with asyncio.TaskGroup() as group:
            for entry in manifest.entries:
                for r in entry.ranges:
                    group.create_task(check(entry.path, r))
    except BaseExceptionGroup as group_error:
        raise (leaf := first_error(group_error)) from leaf.__cause__
    return sorted(f"{where}: {p}" for p in problems)


async def copy_step(
    source: Storage, dest: Storage, manifest: Manifest, *, concurrency: int = 4, progress: Progress | None = None
) -> None:
    """Copy one committed step to another root (``aiosnap download``): each data object is
    read whole, every range's crc32c checked, then written; the manifest goes last, so the
    copy is committed only once complete. A failure removes what was copied and raises
    (:class:`~aiosnap.errors.CorruptCheckpointError` for bad data). Holds at most
    ``concurrency`` objects in memory."""
    where = f"{source.url} step {manifest.step}"
    ranges: dict[str, list[ByteRange]] = {}
    for entry in manifest.entries:
        for r in entry.ranges:
            ranges.setdefault(r.object, []).append(r)
    limit = asyncio.Semaphore(concurrency)

    async def copy(name: str, nbytes: int) -> None:
        async with limit:
            buffer = memoryview(bytearray(nbytes))
            got = await source.read_into(name, 0, buffer)
            if got < nbytes:
                raise TruncatedObjectError(f"{where}: {name!r} is truncated ({got} of {nbytes} bytes)")
            for r in ranges.get(name, []):
                crc = await asyncio.to_thread(crc32c_of, buffer[r.offset : r.offset + r.nbytes])
                if crc != r.crc32c:
                    raise ChecksumMismatchError(
                        f"{where}: checksum mismatch in {name!r} at offset {r.offset} "
                        f"(crc32c {crc:#010x}, manifest says {r.crc32c:#010x}); not copied"
                    )
            await dest.write(name, buffer)
        if progress is not None:
            progress(nbytes)

    try:
        async with asyncio.TaskGroup() as group:
            for obj in manifest.objects:
                group.create_task(copy(obj.name, obj.nbytes))
    except BaseExceptionGroup as group_error:
        await remove_attempt(dest, manifest.step, manifest.save_id)
        raise (leaf := first_error(group_error)) from leaf.__cause__
    await commit_manifest(dest, manifest, replace=False)


@dataclass
class GcReport:
    """What :func:`collect_garbage` removed (or would remove, with ``dry_run``)."""

    deleted_steps: list[int] = field(default_factory=list)
    removed_incomplete: list[str] = field(default_factory=list)
    kept_recent: list[str] = field(default_factory=list)
    """Incomplete folders younger than the grace period (possibly saves in progress)."""
    aborted_uploads: int = 0
    freed_bytes: int = 0


async def collect_garbage(
    storage: Storage, *, keep_last: int, grace_s: float, dry_run: bool = False, now: float | None = None
) -> GcReport:
    """Retention and cleanup: delete committed steps beyond the newest ``keep_last``;
    delete incomplete step folders and leftover attempts whose newest object is older than
    ``grace_s`` (younger ones may be saves in progress and are kept); abort multipart
    uploads started before the grace period (S3)."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    now = time.time() if now is None else now
    report = GcReport()
    committed = await committed_steps(storage)
    objects = _by_step(await storage.walk())
    for step in committed[:-keep_last]:
        report.deleted_steps.append(step)
        report.freed_bytes += sum(o.size for o in objects.get(step_dir(step), []))
        if not dry_run:
            await remove_step(storage, step)
    survivors = set(committed[-keep_last:])
    for folder, found in sorted(objects.items()):
        step = int(folder)
        if step in report.deleted_steps:
            continue
        owner = None
        if step in survivors:
            try:
                owner = (await read_manifest(storage, step)).save_id
            except CorruptCheckpointError:
                continue  # never guess about a step whose manifest cannot be read
        groups: dict[str, list[ObjectInfo]] = {}
        for obj in found:
            parts = obj.name.split("/")
            if parts[-1] == MANIFEST_FILE and len(parts) == 2:
                continue
            prefix = folder if owner is None else "/".join(parts[:2])
            if owner is not None and (len(parts) < 3 or parts[1] == owner):
                continue
            groups.setdefault(prefix, []).append(obj)
        for prefix, members in groups.items():
            if now - max(o.mtime for o in members) < grace_s:
                report.kept_recent.append(prefix)
                continue
            if owner is None and await storage.exists(manifest_name(step)):
                continue  # committed since we listed (e.g. by a concurrent resume): not garbage
            report.removed_incomplete.append(prefix)
            report.freed_bytes += sum(o.size for o in members)
            if not dry_run:
                await storage.delete_prefix(prefix)
    if not dry_run:
        report.aborted_uploads = await storage.abort_stale_uploads(now - grace_s)
    return report
