"""Copying a committed step to another root (``aiosnap download``), every range verified,
the copy committed by the same protocol as a save (manifest last, written only if absent).

Runs on whichever event loop calls it; holds at most ``concurrency`` objects in memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..catalog.steps import committed_save_id, objects_to_keep
from ..core.checksums import crc32c_of
from ..core.names import attempt_prefix, step_dir
from ..errors import AiosnapError, ChecksumMismatchError, CorruptCheckpointError, TruncatedObjectError, first_error
from ..format.manifest import Manifest, Span, manifest_name
from ..storage.base import Storage
from ..storage.registry import roots_overlap
from .commit import commit_manifest
from .references import check_references

__all__ = ["copy_step"]

log = logging.getLogger("aiosnap")
Progress = Callable[[int], None]


async def copy_step(
    source: Storage, dest: Storage, manifest: Manifest, *, concurrency: int = 4, progress: Progress | None = None
) -> bool:
    """Copy one committed step to another root (``aiosnap download``): each data object is
    read whole, every range's crc32c checked, then written; the manifest goes last, so the
    copy is committed only once complete. The objects of earlier saves the step references
    are copied too, under the same names, so the copy stands alone (one that ``dest`` holds
    already, intact, from a copy of an earlier step, is left as it is); right before the
    commit they are checked to be in ``dest`` still, with their sizes. Returns False when ``dest`` already holds this
    very save (nothing to do).

    A copy never removes anything it did not write in this run: a failure deletes the
    objects this run wrote in the step's own attempt folder, and those of earlier saves it
    wrote that no committed manifest of ``dest`` names (another copy's step may), and raises
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
    for _, r in manifest.all_ranges():
        ranges.setdefault(r.object, []).append(r)
    referenced = {o.name for o in manifest.references or ()}
    limit = asyncio.Semaphore(concurrency)
    written: list[str] = []

    async def copy(name: str, nbytes: int) -> None:
        async with limit:
            buffer = memoryview(bytearray(nbytes))
            if name in referenced and await _already_copied(dest, name, buffer, ranges.get(name, [])):
                if progress is not None:
                    progress(nbytes)
                return  # a copy of an earlier step put it there: neither rewritten nor removed by this run
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
            for obj in manifest.stored_objects():  # referenced ones too, under the same names
                group.create_task(copy(obj.name, obj.nbytes))
        if manifest.references:  # another copy into dest that failed may have removed one it wrote
            await check_references(dest, manifest.step, [(o.name, o.rank, o.nbytes) for o in manifest.references])
        await commit_manifest(dest, manifest, replace=False)
    except BaseException as failure:
        await asyncio.shield(_remove_written(dest, written, manifest.step, manifest.save_id))
        if isinstance(failure, BaseExceptionGroup):
            raise (leaf := first_error(failure)) from leaf.__cause__
        raise
    return True


async def _already_copied(dest: Storage, name: str, buffer: memoryview, ranges: list[Span]) -> bool:
    """Whether ``dest`` holds the referenced object ``name`` already, whole and with every
    range's checksum right (read into ``buffer``, its size)."""
    try:
        if await dest.size(name) != len(buffer) or await dest.read_into(name, 0, buffer) < len(buffer):
            return False
    except FileNotFoundError:
        return False
    for r in ranges:
        crc = await asyncio.to_thread(crc32c_of, buffer[r.offset : r.offset + r.nbytes])
        if r.crc32c is not None and crc != r.crc32c:
            return False
    return True


async def _remove_written(dest: Storage, names: list[str], step: int, save_id: str) -> None:
    """Undo a failed copy: the objects this run wrote (of the copied step's own attempt, and of
    earlier saves it references) that no committed manifest of ``dest`` names now, then their
    folders if empty -- unless another run of the same copy committed meanwhile (the objects
    are then that copy's). Its own attempt's objects too may be named: the step was copied
    into ``dest`` before, and a later step copied there references them (same names, same
    bytes, rewritten by this run)."""
    if await committed_save_id(dest, step) == save_id:
        return
    folders = {name.rsplit("/", 1)[0] for name in names} | {attempt_prefix(step, save_id), step_dir(step)}
    try:
        kept = await objects_to_keep(dest) if names else set()  # after the names are known: mark after list
        for name in names:
            if name not in kept:
                await dest.delete(name)
        for folder in sorted(folders, key=lambda f: f.count("/"), reverse=True):  # deepest first
            await dest.remove_empty_folder(folder)
    except Exception as exc:
        log.warning("aiosnap: %s: could not remove what a failed copy wrote: %r", dest.url, exc)
