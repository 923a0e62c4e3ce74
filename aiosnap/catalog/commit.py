"""The commit point of a step: its manifest written once, and read back when in doubt.

Used by every writer of steps: a save's upload (:mod:`aiosnap.transfer.commit` holds the
rest of its protocol), a copy (``aiosnap download``), an import from another format
(``aiosnap export --to aiosnap``). Loop thread of whoever calls.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from ..core.names import manifest_name
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, ManifestError, UnsupportedStateError
from ..format.manifest import Manifest, checked_json
from ..storage.base import Storage
from .steps import committed_document, read_manifest, retire_attempts, trust_committed
from .tombstones import Tombstones

__all__ = [
    "READ_BACK_TIMEOUT_S", "checked_document", "commit_manifest", "remove_replaced", "whose_commit", "write_manifest",
]  # fmt: skip

log = logging.getLogger("aiosnap")

READ_BACK_TIMEOUT_S = 10.0
"""How long reading back an ambiguous commit may take before it is left undecided."""


def checked_document(storage: Storage, manifest: Manifest) -> bytes:
    """The bytes that commit ``manifest``, read back first as a reader would read them: one
    it would refuse is never committed (:class:`UnsupportedStateError`: the state made a
    manifest no reader takes; nothing is written, the latest step stays as it was)."""
    try:
        return checked_json(manifest, f"{storage.url}/{manifest_name(manifest.step)}")[0]
    except ManifestError as exc:
        raise UnsupportedStateError(
            f"step {manifest.step}: this save's manifest would not be read back, so it is not committed ({exc})"
        ) from None


async def commit_manifest(storage: Storage, manifest: Manifest, *, replace: bool, document: bytes | None = None) -> int:
    """Write the manifest: the commit point. Returns its size in bytes. ``document``: its
    bytes as :func:`checked_document` gave them (made here when None).

    A new step's manifest is written only if still absent; :class:`FileExistsError` if
    another writer committed the step first. A re-save (``replace``) replaces the step's
    manifest, then removes the attempt folder the old one named (a failure there is only
    logged: the save has committed)."""
    if document is None:
        document = checked_document(storage, manifest)
    replaced = await write_manifest(storage, manifest, document, replace=replace)
    if replaced is not None:
        await remove_replaced(storage, manifest, replaced[0], old_document=replaced[1])
    return len(document)


async def write_manifest(
    storage: Storage, manifest: Manifest, document: bytes, *, replace: bool
) -> tuple[str | None, bytes] | None:
    """Write ``document`` (``manifest`` as JSON) as the step's manifest: the commit point. A
    new step's only if still absent (:class:`FileExistsError` if another writer committed
    it first). For a re-save (``replace``), what it replaced: that manifest's save id (None
    if unreadable) and bytes; None when nothing was replaced. A manifest with byte ranges
    that carry no crc32c (only translations from foreign formats have them) is refused."""
    if manifest.has_unverified_ranges():
        raise ValueError(f"step {manifest.step}: a manifest with byte ranges that carry no crc32c is never committed")
    name = manifest_name(manifest.step)
    if not replace:
        try:
            await storage.write(name, document, if_absent=True)
        except FileExistsError as exc:
            # A retried conditional write may be refused because its first attempt landed.
            if await whose_commit(storage, manifest.step, manifest.save_id) != "ours":
                raise FileExistsError(
                    f"{storage.url}/{name}: step {manifest.step} was committed by another writer "
                    "while this save ran; not overwriting it"
                ) from exc
        trust_committed(manifest.step, document, manifest.save_id)
        return None
    old = await committed_document(storage, manifest.step)
    await storage.write(name, document)
    trust_committed(manifest.step, document, manifest.save_id)
    return None if old is None else (old[1], old[0])


async def remove_replaced(
    storage: Storage,
    manifest: Manifest,
    replaced: str | None,
    tombstones: Tombstones | None = None,
    old_document: bytes = b"",
) -> None:
    """After a re-save's commit: remove the attempt the old manifest named, and the earlier
    saves' objects the old manifest (``old_document``, when known) referenced, except what
    committed manifests name (:func:`~.steps.retire_attempts`; a failure is only logged:
    the save has committed)."""
    if replaced is None or replaced == manifest.save_id:
        return
    try:
        await retire_attempts(storage, [(manifest.step, replaced, old_document)], tombstones)
    except Exception as exc:
        log.warning("aiosnap: step %d re-saved, but removing the replaced attempt failed: %r", manifest.step, exc)


async def whose_commit(
    storage: Storage, step: int, save_id: str, *, write_interrupted: bool = False
) -> Literal["ours", "other", "unknown"]:
    """Read back ``step``'s manifest: is it this attempt's (``ours``), someone else's
    (``other``), or undecidable (``unknown``: unreadable within :data:`READ_BACK_TIMEOUT_S`;
    or, right after this attempt's own manifest write was interrupted on a backend where an
    abandoned write may still land later, anything but this attempt's manifest)."""
    may_still_land = write_interrupted and not storage.settled_writes
    try:
        async with asyncio.timeout(READ_BACK_TIMEOUT_S):
            manifest = await read_manifest(storage, step)
    except CheckpointNotFoundError:
        return "unknown" if may_still_land else "other"
    except CorruptCheckpointError:
        return "unknown"
    except Exception as exc:  # storage down, timed out: undecided
        log.warning("aiosnap: cannot read back the manifest of step %d (%r)", step, exc)
        return "unknown"
    if manifest.save_id == save_id:
        return "ours"
    return "unknown" if may_still_land else "other"
