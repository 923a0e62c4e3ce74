"""The commit protocol of aiosnap's DCP writer (coroutines on the runtime's loop).

1. *Look* (``prepare_global_plan``, coordinator): is there a ``.metadata`` already? If not,
   the commit will write it only if still absent, so that of two writers of one new
   checkpoint the second fails (``FileExistsError``) instead of replacing the first. If
   there is one (an overwrite; refused with ``overwrite=False``), the data files it names
   are remembered, to be removed once the new checkpoint has committed.
2. Every rank writes its data files under names of this attempt alone
   (:mod:`.upload`), so the old checkpoint stays whole and loadable throughout.
3. *Commit* (``finish``, coordinator): the checksums file, then ``.metadata`` last: written
   whole (a temporary file renamed into place, or one PUT), conditionally for a new
   checkpoint. It is read back; once it is this attempt's, the replaced checkpoint's data
   files (only ``*.distcp`` files its metadata named, and its checksums file) are removed.
   If another writer's ``.metadata`` won, this attempt's own files are removed where no
   write of them can still be under way; else they are left (no ``.metadata`` names them).
4. *Strays*: files of attempts that never committed (a rank or process killed mid-save, a
   commit whose outcome could not be known) are named by no ``.metadata``. The folder is
   listed just before the commit: a save whose own files are not all there does not commit
   (:class:`~aiosnap.errors.StorageError`); after it, files of that listing in aiosnap's
   attempt names (``__<rank>_<n>.<save id>.distcp``, ``.aiosnap-checksums.<save id>.json``)
   of other attempts, and last modified more than :data:`STRAY_GRACE_S` ago (younger ones
   may belong to a save still running), are removed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

from ...errors import CorruptCheckpointError, StorageError
from ...storage.base import Storage
from .checksums import checksums_name, is_aiosnap_save_id
from .metadata import MAX_METADATA_BYTES, METADATA_FILE, parse_metadata

__all__ = ["CommitPlan", "abandon", "commit", "look"]

log = logging.getLogger("aiosnap")
READ_BACK_TIMEOUT_S = 10.0
STRAY_GRACE_S = 3600.0
"""Age (by last modification) past which an attempt file no ``.metadata`` names is removed
by the next commit in its folder (as ``aiosnap gc``'s default grace)."""
_ATTEMPT_FILE = re.compile(r"__\d+_\d+\.([0-9a-f]{16})\.distcp|\.aiosnap-checksums\.([0-9a-f]{16})\.json")


@dataclass(frozen=True)
class CommitPlan:
    """What the coordinator found when the save started."""

    if_absent: bool
    """No checkpoint was there: write ``.metadata`` only if still absent."""
    replaced: list[str] = field(default_factory=list)
    """Files of the checkpoint being overwritten, removed after the commit."""


async def look(storage: Storage, *, overwrite: bool) -> CommitPlan:
    """What is at the checkpoint's place now (see the module)."""
    try:
        data = await storage.read(METADATA_FILE, limit=MAX_METADATA_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return CommitPlan(if_absent=True)
    if not overwrite:
        raise FileExistsError(f"{storage.url} holds a DCP checkpoint already (overwrite=False)")
    try:
        meta = parse_metadata(data, f"{storage.url}/{METADATA_FILE}")
    except CorruptCheckpointError as exc:  # replaced, but nothing of it is removed: we cannot tell what it was
        log.warning("aiosnap: overwriting %s, whose .metadata cannot be read (%s); its files stay", storage.url, exc)
        return CommitPlan(if_absent=False)
    replaced = [name for name in meta.files if name.endswith(".distcp") and "/" not in name]
    if is_aiosnap_save_id(meta.save_id):
        assert meta.save_id is not None
        replaced.append(checksums_name(meta.save_id))
    return CommitPlan(if_absent=False, replaced=replaced)


async def _read_back(storage: Storage) -> bytes | None:
    """The ``.metadata`` there now (empty when there is none); None when it cannot be read."""
    try:
        async with asyncio.timeout(READ_BACK_TIMEOUT_S):
            return await storage.read(METADATA_FILE, limit=MAX_METADATA_BYTES)
    except FileNotFoundError:
        return b""
    except Exception as exc:  # down: undecided
        log.warning("aiosnap: cannot read back %s/%s (%r)", storage.url, METADATA_FILE, exc)
        return None


async def _remove(storage: Storage, names: list[str], why: str) -> None:
    for name in names:
        try:
            await storage.delete(name)
        except Exception as exc:  # the commit stands; these are only left behind
            log.warning("aiosnap: could not remove %s/%s (%s): %r", storage.url, name, why, exc)
            return


async def abandon(storage: Storage, own: list[str]) -> None:
    """Remove the data files ``own`` of an attempt that will not commit (every write of
    them has returned: nothing of them can still land)."""
    await _remove(storage, own, "data of a save refused before its commit")


async def _strays_and_check(storage: Storage, save_id: str, own: list[str]) -> list[str]:
    """The folder's attempt files of other attempts older than the grace period; raise if
    one of this attempt's ``own`` files is not there (its others removed). A backend that
    cannot list (:meth:`~aiosnap.storage.base.Storage.walk`) is neither checked nor swept."""
    try:
        listing = await storage.walk()
    except NotImplementedError:
        return []
    names = {info.name for info in listing}
    missing = sorted(set(own) - names)
    if missing:
        await _remove(storage, [name for name in own if name in names], "data of a save that did not commit")
        raise StorageError(
            f"{storage.url}: {len(missing)} data file(s) of this save vanished before its commit "
            f"({missing[:3]}); not committed"
        )
    old = time.time() - STRAY_GRACE_S
    strays = []
    for info in listing:
        match = _ATTEMPT_FILE.fullmatch(info.name)
        if match is not None and save_id not in match.groups() and info.mtime < old:
            strays.append(info.name)
    return strays


async def commit(
    storage: Storage, plan: CommitPlan, metadata: bytes, checksums: bytes, save_id: str, own: list[str]
) -> None:
    """Write the checksums and then ``.metadata`` (see the module). ``own``: this
    attempt's data files (every rank's)."""
    mine = [*own, checksums_name(save_id)]
    strays = await _strays_and_check(storage, save_id, own)
    await storage.write(checksums_name(save_id), checksums)
    try:
        await storage.write(METADATA_FILE, metadata, if_absent=plan.if_absent)
    except FileExistsError as exc:
        # a retried conditional write may be refused because its first attempt landed
        if await _read_back(storage) == metadata:
            return
        if storage.settled_writes:
            await _remove(storage, mine, "data of a save another writer beat")
        raise FileExistsError(
            f"{storage.url}: another writer committed a DCP checkpoint here while this save ran; not replacing it"
        ) from exc
    except BaseException as exc:
        # the write failed (or was cancelled): did it land anyway? If not, this attempt's
        # files go where no write of them can still land; else they stay, named by nothing
        current = await _read_back(storage)
        if current != metadata or not isinstance(exc, Exception):
            if storage.settled_writes and current not in (metadata, None):
                await _remove(storage, mine, "data of a save whose commit failed")
            raise
        log.info("aiosnap: %s committed although writing its .metadata reported %r", storage.url, exc)
    current = await _read_back(storage)
    if current and current != metadata:
        log.warning("aiosnap: %s was committed, then replaced by another writer's checkpoint at once", storage.url)
        await _remove(storage, mine, "data of a save another writer replaced")
        return
    await _remove(storage, [name for name in plan.replaced if name not in mine], "files of the replaced checkpoint")
    await _remove(storage, [name for name in strays if name not in plan.replaced], "files of attempts never committed")
