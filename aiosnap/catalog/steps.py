"""The catalog of a storage root: which steps exist, the latest, retention, removal.

Reads storage, owns no bytes; coroutines run on whichever loop calls them (aiosnap's
background loop for checkpointers, the CLI's own loop for maintenance). A step counts as
committed exactly when its manifest exists; removing a step deletes the manifest first,
so a half-removed step is never taken for a checkpoint. Only folders named exactly as
aiosnap names steps are considered (see :mod:`aiosnap.core.names`); nothing else in a root is
listed or deleted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence, Set

from ..core.names import attempt_prefix, manifest_name, parse_step_dir, step_dir
from ..errors import AiosnapError, CheckpointNotFoundError, CorruptCheckpointError, StorageError
from ..format.manifest import MAX_MANIFEST_BYTES, Manifest
from ..storage.base import Storage
from .keep import KeptNames, names_in_manifest
from .pins import pins_for
from .tombstones import Tombstones, retire_attempt
from .trusted import TRUSTED

__all__ = [
    "apply_retention",
    "committed_document",
    "committed_steps",
    "latest_committed",
    "manifest_of",
    "not_committed",
    "objects_to_keep",
    "read_manifest",
    "remove_step",
    "remove_steps",
    "retire_attempts",
    "retention_victims",
    "remove_steps_after",
    "step_folders",
    "trust_committed",
]

log = logging.getLogger("aiosnap")


async def step_folders(storage: Storage) -> list[int]:
    """Steps that have a folder (committed or not), ascending."""
    names = await storage.list_children("")
    return sorted({step for step in map(parse_step_dir, names) if step is not None})


LISTINGS = 8
"""Most listings of a root that one look-up makes while other processes change it."""


async def committed_steps(storage: Storage) -> list[int]:
    """Steps with a manifest, ascending. Folders without one (saves in progress or failed)
    are left out. See :func:`latest_committed` for a root that changes meanwhile."""

    async def committed(listed: list[int]) -> list[int]:
        present = await asyncio.gather(*(storage.exists(manifest_name(s)) for s in listed))
        return [step for step, ok in zip(listed, present, strict=True) if ok]

    return await _look_until_settled(storage, committed)


async def latest_committed(storage: Storage) -> int | None:
    """The newest committed step (None when there is none): one listing, then one HEAD
    per step folder from the newest down until a manifest is found. Folders listed but no
    manifest found may mean that the root changed during the look (another process
    committed a newer step and its retention deleted the one looked at): the root is then
    listed and looked at again, until a look finds nothing in a listing that did not change."""

    async def newest(listed: list[int]) -> list[int]:
        for step in reversed(listed):
            if await storage.exists(manifest_name(step)):
                return [step]
        return []

    found = await _look_until_settled(storage, newest)
    return found[0] if found else None


async def _look_until_settled(storage: Storage, look: Callable[[list[int]], Awaitable[list[int]]]) -> list[int]:
    """``look(step folders)``; when it finds nothing among the folders listed, listed and
    looked at again, until nothing is found in the same listing twice in a row (a commit
    adds a manifest to a folder listed before: one look can miss it while another process's
    retention deletes the step it would have found)."""
    listed, previous = await step_folders(storage), None
    for _ in range(LISTINGS):
        found = await look(listed)
        if found or not listed or listed == previous:
            return found
        previous, listed = listed, await step_folders(storage)
    raise CheckpointNotFoundError(
        f"no committed checkpoint found in {storage.url}: its step folders changed at each of {LISTINGS} "
        "listings, each time without a manifest (other processes commit and delete steps faster than they "
        "can be looked up; try again)"
    )


async def read_manifest(storage: Storage, step: int) -> Manifest:
    """The validated manifest of ``step``; CheckpointNotFoundError if it is not committed,
    ManifestError (a CorruptCheckpointError) if it cannot be trusted. A foreign checkpoint
    (a DCP folder, ...) gives the manifest translated from its own metadata."""
    translated = await storage.translated_manifest(step)
    if translated is not None:
        assert isinstance(translated, Manifest)
        return translated
    return _validated(await _manifest_bytes(storage, step), storage, step)


async def _manifest_bytes(storage: Storage, step: int) -> bytes:
    try:
        return await storage.read(manifest_name(step), limit=MAX_MANIFEST_BYTES)
    except FileNotFoundError as exc:  # one request: the committed steps are listed only for a person
        raise CheckpointNotFoundError(f"step {step} has no committed checkpoint in {storage.url}") from exc


async def not_committed(storage: Storage, step: int, purpose: str = "") -> CheckpointNotFoundError:
    """The error for a ``step`` that is not committed, listing the steps that are: for a
    message a person reads (it lists the root). A listing that fails is left out of it."""
    try:
        steps = await committed_steps(storage)
    except (OSError, AiosnapError) as exc:
        available = f"the committed steps could not be listed ({type(exc).__name__}: {exc})"
    else:
        shown = ", ".join(map(str, steps[-20:]))
        more = f"{len(steps) - 20} older and " if len(steps) > 20 else ""
        available = f"the committed steps are {more}{shown}" if steps else "it holds no committed step"
    return CheckpointNotFoundError(f"step {step} has no committed checkpoint in {storage.url}{purpose}; {available}")


def _validated(data: bytes, storage: Storage, step: int) -> Manifest:
    where = f"{storage.url}/{manifest_name(step)}"
    known = TRUSTED.manifest(step, data)
    if known is not None and known.foreign is None:  # stored bytes never stand for a translation
        return known
    manifest = Manifest.from_json(data, where=where)
    if manifest.step != step:
        raise CorruptCheckpointError(f"{where}: manifest says step {manifest.step}, not {step}")
    TRUSTED.learn(step, data, manifest.save_id)
    return manifest


def trust_committed(step: int, document: bytes, save_id: str) -> None:
    """This process just committed ``document``, which it read back with the readers' own
    parser and validator before writing it (:func:`~aiosnap.format.manifest.checked_json`):
    the same bytes read back need no second validation."""
    TRUSTED.learn(step, document, save_id)


async def manifest_of(storage: Storage, step: int | None) -> Manifest:
    """The manifest of ``step``, or of the latest committed step when None: for a load, or
    for a person (a missing ``step``'s error lists the committed steps). A latest step
    removed between its look-up and its read (retention in another process) is looked up
    again. A step whose manifest cannot be read is an error (never silently an older step),
    which names the newest older step that can be read."""
    if step is not None:
        try:
            return await _read_naming_older(storage, step)
        except CheckpointNotFoundError as exc:
            raise await not_committed(storage, step) from exc
    for _ in range(LISTINGS):
        latest = await latest_committed(storage)
        if latest is None:
            raise CheckpointNotFoundError(f"no committed checkpoint in {storage.url}")
        try:
            return await _read_naming_older(storage, latest)
        except CheckpointNotFoundError:
            continue  # removed since the look-up: the latest is another step now
    raise CheckpointNotFoundError(
        f"no committed checkpoint could be read in {storage.url}: the latest step was removed before its "
        f"manifest was read, {LISTINGS} times (other processes delete steps as fast as they are looked up)"
    )


async def _read_naming_older(storage: Storage, step: int) -> Manifest:
    """:func:`read_manifest`; a damaged manifest's error names the newest older step that
    can be read, and how to go on from it."""
    try:
        return await read_manifest(storage, step)
    except CorruptCheckpointError as exc:
        steps = await committed_steps(storage)
        for candidate in reversed([s for s in steps if s < step]):
            if await committed_save_id(storage, candidate) is not None:
                again = f", or make it the latest again with rollback({candidate})" if step == steps[-1] else ""
                raise type(exc)(
                    f"{exc} -- the newest loadable step is {candidate}: load(step={candidate}){again}"
                ) from exc
        raise


async def committed_save_id(storage: Storage, step: int) -> str | None:
    """The save id of ``step``'s manifest; None when there is none or it cannot be read.
    A manifest this process has validated before, byte for byte, is not validated again."""
    found = await committed_document(storage, step)
    return None if found is None else found[1]


async def committed_document(storage: Storage, step: int) -> tuple[bytes, str | None] | None:
    """The bytes of ``step``'s manifest and its save id (None when it cannot be read); None
    when there is no manifest."""
    try:
        data = await _manifest_bytes(storage, step)
    except CheckpointNotFoundError:
        return None
    known = TRUSTED.save_id(step, data)
    if known is not None:
        return data, known
    try:
        return data, _validated(data, storage, step).save_id
    except CorruptCheckpointError:
        return data, None


async def objects_to_keep(storage: Storage, leaving: Set[int] = frozenset()) -> set[str]:
    """What no deletion may remove now (see :mod:`.keep`): every object a save in flight in
    this process pins, then every object a committed manifest names, its own and its
    references, read in that order and *after* the caller listed what it would delete.
    ``leaving``: steps whose manifests do not count (a plan that will remove them first).

    A manifest listed and gone by its read, or a listing of the committed steps that differs
    once the manifests are read, means another process committed a newer step meanwhile (and
    its retention may have deleted the one listed): the newer step's references would be in
    no manifest read. The whole mark is then made again, until a mark reads every manifest
    listed and the listing after it agrees; when that never happens in :data:`LISTINGS`
    marks, StorageError: the caller deletes nothing."""
    listed = await committed_steps(storage)
    for _ in range(LISTINGS):
        keep = KeptNames(pins_for(storage.url).pinned())
        steps = [s for s in listed if s not in leaving]
        documents = await asyncio.gather(*(committed_document(storage, s) for s in steps))
        for step, found in zip(steps, documents, strict=True):
            if found is not None:
                keep |= names_in_manifest(step, found[0], valid=found[1] is not None)
                if found[1] is None:  # refused: it may have lost the names of what it references
                    keep.hold_through(step)
                    _say_held(storage, step)
        again = await committed_steps(storage)
        if again == listed and all(found is not None for found in documents):
            return keep
        listed = again
    raise StorageError(
        f"what to keep in {storage.url} could not be read: its committed steps changed during each of "
        f"{LISTINGS} reads (other processes commit and delete steps meanwhile); nothing was deleted, try again"
    )


_said_held: set[tuple[str, int]] = set()


def _say_held(storage: Storage, step: int) -> None:
    """Warn once per process and step: an unreadable manifest holds every older step's data."""
    if (storage.url, step) not in _said_held:
        _said_held.add((storage.url, step))
        log.warning(
            "aiosnap: %s step %d: its manifest cannot be read (damaged, or written by a newer aiosnap); until it is "
            "repaired, rolled back or purged, no deletion removes data of it or of any earlier step", storage.url, step,
        )  # fmt: skip


async def remove_step(storage: Storage, step: int, tombstones: Tombstones | None = None) -> None:
    """:func:`remove_steps` of one step."""
    await remove_steps(storage, [step], tombstones)


async def remove_steps(storage: Storage, steps: Sequence[int], tombstones: Tombstones | None = None) -> list[str]:
    """Uncommit each of ``steps`` (every manifest first, in the order given), then delete the
    objects of the attempts they named and the objects of earlier saves they referenced,
    except those another committed manifest names or a save in flight pins (:mod:`.keep`:
    they stay where they are, and go with the last step that names them): the attempt
    folders are listed, then what to keep is read once, then what is listed and not kept
    goes. With ``tombstones``, a multi-rank attempt's verdict stays a while (see
    :mod:`.tombstones`). Other attempt folders of these steps (crashed or concurrent saves)
    are left to ``aiosnap gc``; so is the data of a step whose manifest could not be read.
    Returns the attempt folders left holding objects that other steps name."""
    doomed: list[tuple[int, str, bytes]] = []
    for step in steps:
        found = await committed_document(storage, step)
        await storage.delete(manifest_name(step))
        if found is not None and found[1] is not None:
            doomed.append((step, found[1], found[0]))
    held = await retire_attempts(storage, doomed, tombstones)
    for step in steps:
        await storage.remove_empty_folder(step_dir(step))
    return held


async def retire_attempts(
    storage: Storage, attempts: Sequence[tuple[int, str, bytes]], tombstones: Tombstones | None = None
) -> list[str]:
    """Delete the ``(step, save id, manifest bytes)`` attempts whose manifests are gone or
    replaced, and the earlier saves' objects those manifests referenced, keeping what
    :func:`objects_to_keep` says after the folders are listed (see :func:`remove_steps`).
    Returns the attempt folders left holding objects that other steps name."""
    doomed = list(attempts)
    listed = [await _listing(storage, attempt_prefix(step, save_id)) for step, save_id, _ in doomed]
    kept = await objects_to_keep(storage) if doomed else set()  # after the listings: mark after list

    async def keep() -> set[str]:
        return kept

    held: list[str] = []
    for (step, save_id, _), names in zip(doomed, listed, strict=True):
        if await retire_attempt(storage, step, save_id, tombstones, keep=keep, listed=names):
            held.append(attempt_prefix(step, save_id))
    folders = tuple(attempt_prefix(step, save_id) + "/" for step, save_id, _ in doomed)
    unnamed = {n for step, _, data in doomed for n in names_in_manifest(step, data, valid=True)}
    await _delete_with_folders(storage, sorted(n for n in unnamed if n not in kept and not n.startswith(folders)))
    return held


async def _listing(storage: Storage, prefix: str) -> list[str] | None:
    try:
        return [o.name for o in await storage.walk(prefix)]
    except NotImplementedError:
        return None


async def _delete_with_folders(storage: Storage, names: list[str]) -> None:
    """Delete ``names`` (objects of earlier saves nothing names any more), then the folders
    they leave empty."""
    if not names:
        return
    await storage.delete_many(names)
    folders = {name.rsplit("/", 1)[0] for name in names}
    folders |= {folder.rsplit("/", 1)[0] for folder in folders} | {folder.split("/", 1)[0] for folder in folders}
    for folder in sorted(folders, key=lambda f: f.count("/"), reverse=True):  # deepest first
        await storage.remove_empty_folder(folder)


async def retention_victims(storage: Storage, keep_last: int, spare: set[int]) -> list[int]:
    """Committed steps retention would delete: the readable ones older than the newest
    ``keep_last`` readable steps, never those in ``spare``. A step whose manifest cannot be
    read (damaged, or written by a newer aiosnap) neither counts as kept nor is deleted: so a
    damaged newest step never makes retention delete the last loadable one."""
    victims: list[int] = []
    readable = 0
    for step in reversed(await committed_steps(storage)):
        if await committed_save_id(storage, step) is None:
            continue  # damaged, or removed meanwhile
        readable += 1
        if readable > keep_last and step not in spare:
            victims.append(step)
    return sorted(victims)


async def apply_retention(
    storage: Storage,
    keep_last: int | None,
    just_committed: int,
    in_flight_steps: set[int],
    tombstones: Tombstones | None = None,
) -> list[int]:
    """Delete what :func:`retention_victims` names; never ``just_committed`` and never a
    step with a save in flight (``tombstones``: see :func:`remove_step`). Returns the steps
    deleted."""
    if keep_last is None:
        return []
    doomed = await retention_victims(storage, keep_last, {just_committed, *in_flight_steps})
    await remove_steps(storage, doomed, tombstones)
    return doomed


async def remove_steps_after(storage: Storage, step: int) -> list[int]:
    """Make ``step`` the latest again: remove every committed step after it, newest first
    (each manifest before its data). ``step`` must be committed. Returns the steps removed."""
    steps = await committed_steps(storage)
    if step not in steps:
        raise await not_committed(storage, step, " to roll back to")
    newer = [s for s in steps if s > step]
    await remove_steps(storage, newer[::-1])
    return newer


async def remove_everything(storage: Storage) -> list[int]:
    """Delete every committed step's manifest (newest first, each before its data), then
    every step folder, then the root folder itself where that means anything and it is
    empty. Files that are not aiosnap's stay. The caller makes sure no save to ``storage``
    is running. Returns the committed steps deleted."""
    steps = await committed_steps(storage)
    await remove_steps(storage, steps[::-1])  # no step stays to name anything: only pins keep
    for name in await storage.list_children(""):
        if parse_step_dir(name) is not None:
            await storage.delete_prefix(name)
    await storage.remove_empty_folder()
    return steps
