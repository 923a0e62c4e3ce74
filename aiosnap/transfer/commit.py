"""The commit protocol of one save attempt (loop thread).

1. *Preflight*, when the save starts: the newest committed step of the root. A step older
   than it is refused (steps only move forward, so "latest" is always the newest save);
   the same step is a re-save that replaces it; a newer one is a new step, whose manifest
   will be written only if still absent, so a second writer of the same new step can never
   silently overwrite the first.
2. Data objects, all under the attempt's own folder ``<step>/<save id>/``.
3. The manifest, last: the commit point.
4. After a failure: until the manifest write has started, the attempt's folder is removed
   (it is this attempt's alone). Once it has started, the outcome is read back: the
   attempt's data is removed only if the step's manifest is provably someone else's; if
   it is this attempt's, the save committed after all; if it cannot be read, the data is
   left for ``aiosnap gc``.

Nothing here deletes another attempt's folder, except the one a re-save replaced.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Literal

from ..catalog.steps import committed_save_id, latest_committed, read_manifest, trust_committed
from ..core.names import attempt_prefix, manifest_name, step_dir
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, StepOrderError
from ..format.manifest import Manifest
from ..storage.base import Storage

__all__ = ["Preflight", "commit_manifest", "preflight", "remove_attempt", "whose_commit"]

log = logging.getLogger("aiosnap")

READ_BACK_TIMEOUT_S = 10.0
"""How long reading back an ambiguous commit may take before it is left undecided."""


@dataclass(frozen=True)
class Preflight:
    """What the root held when a save of ``step`` started."""

    step: int
    latest: int | None

    @property
    def replaces(self) -> bool:
        """A re-save of the latest step (its manifest is replaced)."""
        return self.latest == self.step

    def check(self, url: str) -> None:
        """Raise :class:`StepOrderError` for a step older than the latest committed one."""
        if self.latest is not None and self.step < self.latest:
            raise StepOrderError(
                f"step {self.step} is older than the latest committed step {self.latest} in {url}: steps only "
                f"move forward, so load() would still return step {self.latest}. To continue from an earlier "
                f"step N, first remove the newer steps with ckpt.rollback(N) (or `aiosnap rollback {url} "
                f"--to N`), or save to another root with ckpt.at(url)"
            )


async def preflight(storage: Storage, step: int) -> Preflight:
    """Look at the root as a save of ``step`` starts (one listing, usually one HEAD)."""
    return Preflight(step, await latest_committed(storage))


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


async def remove_attempt(storage: Storage, step: int, save_id: str) -> None:
    """Best-effort removal of one failed attempt's folder (this process's own)."""
    try:
        await storage.delete_prefix(attempt_prefix(step, save_id))
        await storage.remove_empty_folder(step_dir(step))
    except Exception as exc:  # cleanup must not hide the failure that got us here
        log.warning("aiosnap: could not remove data of failed save at step %d (left for gc): %r", step, exc)
