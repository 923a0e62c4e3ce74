"""Copying a committed step to another root (``aiosnap download``), every range verified,
the copy committed by the same protocol as a save (manifest last, written only if absent).

Runs on whichever event loop calls it; holds at most ``concurrency`` objects in memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..catalog.steps import committed_save_id
from ..core.checksums import crc32c_of
from ..core.names import attempt_prefix, step_dir
from ..errors import AiosnapError, ChecksumMismatchError, CorruptCheckpointError, TruncatedObjectError, first_error
from ..format.manifest import Manifest, Span, manifest_name
from ..storage.base import Storage
from ..storage.registry import roots_overlap
from .commit import commit_manifest

__all__ = ["copy_step"]

log = logging.getLogger("aiosnap")
Progress = Callable[[int], None]


async def copy_step(
    source: Storage, dest: Storage, manifest: Manifest, *, concurrency: int = 4, progress: Progress | None = None
) -> bool:
    """Copy one committed step to another root (``aiosnap download``): each data object is
    read whole, every range's crc32c checked, then written; the manifest goes last, so the
    copy is committed only once complete. Returns False when ``dest`` already holds this
    very save (nothing to do).

    A copy never removes anything it did not write in this run: a failure deletes the
    objects this run wrote (nothing else) and raises
    (:class:`~aiosnap.errors.CorruptCheckpointError` for bad data). Refused: roots that
    overlap (the same root spelled twice, or one inside the other), and a ``dest`` holding
    the same step from another save. Holds at most ``concurrency`` objects in memory."""
    if roots_overlap(source, dest):
        raise AiosnapError(f"{dest.url} and {source.url} overlap: copy a step to a root outside its own")
    where = f"{source.url} step {manifest.step}"
    present = await committed_save_id(dest, manifest.step)
    if present == manifest.save_id:
        return False
    if present is not None:
        raise AiosnapError(
            f"{dest.url} already holds step {manifest.step} from another save ({present}); not replacing it"
        )
    if await dest.exists(manifest_name(manifest.step)):
        raise AiosnapError(
            f"{dest.url} holds a manifest for step {manifest.step} that cannot be read; not touching that step "
            f"(`aiosnap ls {dest.url}` says why)"
        )
    ranges: dict[str, list[Span]] = {}
    for _, r in manifest.all_ranges():  # as stored: a compressed range's frame and its crc32c
        ranges.setdefault(r.object, []).append(r)
    limit = asyncio.Semaphore(concurrency)
    written: list[str] = []
    referenced = {o.name for o in manifest.references or ()}

    async def copy(name: str, nbytes: int) -> None:
        if name in referenced and await _holds(dest, name, nbytes):
            return  # an earlier step's object, copied before (by a copy of that step): left as it is
        async with limit:
            buffer = memoryview(bytearray(nbytes))
            try:
                got = await source.read_into(name, 0, buffer)
            except FileNotFoundError as exc:
                raise CorruptCheckpointError(f"{where}: data object {name!r} is missing") from exc
            if got < nbytes:
                raise TruncatedObjectError(f"{where}: {name!r} is truncated ({got} of {nbytes} bytes)")
            for r in ranges.get(name, []):
                crc = await asyncio.to_thread(crc32c_of, buffer[r.offset : r.offset + r.nbytes])
                if r.crc32c is not None and crc != r.crc32c:
                    raise ChecksumMismatchError(
                        f"{where}: checksum mismatch in {name!r} at offset {r.offset} "
                        f"(crc32c {crc:#010x}, manifest says {r.crc32c:#010x}); not copied"
                    )
            written.append(name)  # before the write: a write cut short may have left it
            await dest.write(name, buffer)
        if progress is not None:
            progress(nbytes)

    try:
        async with asyncio.TaskGroup() as group:
            for obj in manifest.stored_objects():  # referenced objects too: the copy stands alone
                group.create_task(copy(obj.name, obj.nbytes))
        await commit_manifest(dest, manifest, replace=False)
    except BaseException as failure:
        await asyncio.shield(_remove_written(dest, written, manifest.step, manifest.save_id))
        if isinstance(failure, BaseExceptionGroup):
            raise (leaf := first_error(failure)) from leaf.__cause__
        raise
    return True


async def _holds(storage: Storage, name: str, nbytes: int) -> bool:
    try:
        return await storage.size(name) == nbytes
    except FileNotFoundError:
        return False


async def _remove_written(dest: Storage, names: list[str], step: int, save_id: str) -> None:
    """Undo a failed copy: the objects this run wrote, then their folders if empty -- unless
    another run of the same copy committed meanwhile (the objects are then that copy's)."""
    if await committed_save_id(dest, step) == save_id:
        return
    folders = {name.rsplit("/", 1)[0] for name in names} | {attempt_prefix(step, save_id), step_dir(step)}
    try:
        for name in names:
            await dest.delete(name)
        for folder in sorted(folders, key=lambda f: f.count("/"), reverse=True):  # deepest first
            await dest.remove_empty_folder(folder)
    except Exception as exc:
        log.warning("aiosnap: %s: could not remove what a failed copy wrote: %r", dest.url, exc)
