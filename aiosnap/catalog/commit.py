"""The commit point of a step: its manifest written once, and read back when in doubt.

Used by every writer of steps: a save's upload (:mod:`aiosnap.transfer.commit` holds the
rest of its protocol), a copy (``aiosnap download``), an import from another format
(``aiosnap export --to aiosnap``). Loop thread of whoever calls.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from ..core.names import attempt_prefix, manifest_name
from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..format.manifest import Manifest
from ..storage.base import Storage
from .steps import committed_save_id, read_manifest, trust_committed

__all__ = ["READ_BACK_TIMEOUT_S", "commit_manifest", "whose_commit"]

log = logging.getLogger("aiosnap")

READ_BACK_TIMEOUT_S = 10.0
"""How long reading back an ambiguous commit may take before it is left undecided."""


async def commit_manifest(storage: Storage, manifest: Manifest, *, replace: bool) -> int:
    """Write the manifest: the commit point. Returns its size in bytes.

    A new step's manifest is written only if still absent; :class:`FileExistsError` if
    another writer committed the step first. A re-save (``replace``) replaces the step's
    manifest, then removes the attempt folder the old one named (a failure there is only
    logged: the save has committed)."""
    if manifest.has_unverified_ranges():  # only manifests translated from foreign formats have them
        raise ValueError(f"step {manifest.step}: a manifest with byte ranges that carry no crc32c is never committed")
    name = manifest_name(manifest.step)
    document = manifest.to_json()
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
        return len(document)
    replaced = await committed_save_id(storage, manifest.step)
    await storage.write(name, document)
    trust_committed(manifest.step, document, manifest.save_id)
    if replaced is not None and replaced != manifest.save_id:
        try:
            await storage.delete_prefix(attempt_prefix(manifest.step, replaced))
        except Exception as exc:
            log.warning("aiosnap: step %d re-saved, but removing the replaced attempt failed: %r", manifest.step, exc)
    return len(document)


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
