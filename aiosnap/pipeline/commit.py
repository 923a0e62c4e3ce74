"""Commit stage and the step catalogue: manifest last, retention after commit.

Runs on the background loop thread. A step counts as committed exactly when its manifest
exists; deleting a step removes the manifest first, so a half-deleted step is never taken
for a checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..manifest import MANIFEST_FILE, Manifest, manifest_name
from ..plan import step_dir
from ..storage.base import Storage

__all__ = [
    "apply_retention",
    "commit_manifest",
    "committed_steps",
    "manifest_of",
    "read_manifest",
    "remove_attempt",
    "remove_everything",
    "remove_step",
]

log = logging.getLogger("aiosnap")


async def committed_steps(storage: Storage) -> list[int]:
    """Steps with a manifest, ascending. Folders without one (saves in progress or failed)
    are left out."""
    candidates = [int(name) for name in await storage.list_children("") if name.isdigit()]
    present = await asyncio.gather(*(storage.exists(manifest_name(s)) for s in candidates))
    return sorted(step for step, ok in zip(candidates, present, strict=True) if ok)


async def read_manifest(storage: Storage, step: int) -> Manifest:
    """The validated manifest of ``step``; CheckpointNotFoundError if it is not committed."""
    name = manifest_name(step)
    try:
        data = await storage.read(name)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"step {step} has no committed checkpoint in {storage.url}") from exc
    manifest = Manifest.from_json(data, where=f"{storage.url}/{name}")
    if manifest.step != step:
        raise CorruptCheckpointError(f"{storage.url}/{name}: manifest says step {manifest.step}, not {step}")
    return manifest


async def manifest_of(storage: Storage, step: int | None) -> Manifest:
    """The manifest of ``step``, or of the latest committed step when None."""
    if step is None:
        steps = await committed_steps(storage)
        if not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint in {storage.url}")
        step = steps[-1]
    return await read_manifest(storage, step)


async def commit_manifest(storage: Storage, manifest: Manifest, in_flight: set[str]) -> int:
    """Write the manifest (the commit point), then drop other attempts at the same step.

    A new step's manifest is written only if still absent (a conditional write), so two
    writers never silently overwrite one committed step; re-saving a step replaces it.

    Attempts whose save id is in ``in_flight`` (saves still running) are left alone. Once
    the manifest is written the save has committed: a failing cleanup is only logged.
    Returns the manifest's size in bytes.
    """
    name = manifest_name(manifest.step)
    new_step = not await storage.exists(name)
    document = manifest.to_json()
    try:
        await storage.write(name, document, if_absent=new_step)
    except FileExistsError as exc:
        # A retried conditional write may be refused because its first attempt landed.
        if not await _committed_by(storage, manifest.step, manifest.save_id):
            raise FileExistsError(
                f"{storage.url}/{name}: step {manifest.step} was committed by another writer "
                "while this save ran; not overwriting it"
            ) from exc
    try:
        for name in await storage.list_children(step_dir(manifest.step)):
            if name not in (MANIFEST_FILE, manifest.save_id) and name not in in_flight and not name.startswith("."):
                await storage.delete_prefix(f"{step_dir(manifest.step)}/{name}")
    except Exception as exc:
        log.warning("aiosnap: step %d committed, but removing older attempts failed: %r", manifest.step, exc)
    return len(document)


async def _committed_by(storage: Storage, step: int, save_id: str) -> bool:
    try:
        return (await read_manifest(storage, step)).save_id == save_id
    except (CheckpointNotFoundError, CorruptCheckpointError):
        return False


async def remove_attempt(storage: Storage, step: int, save_id: str) -> None:
    """Best-effort removal of a failed attempt's data objects."""
    try:
        await storage.delete_prefix(f"{step_dir(step)}/{save_id}")
    except Exception as exc:  # cleanup must not hide the failure that got us here
        log.warning("aiosnap: could not remove data of failed save at step %d: %r", step, exc)


async def remove_step(storage: Storage, step: int) -> None:
    """Uncommit (manifest first), then delete the step's data."""
    await storage.delete(manifest_name(step))
    with suppress(FileNotFoundError):
        await storage.delete_prefix(step_dir(step))


async def apply_retention(
    storage: Storage, keep_last: int | None, just_committed: int, in_flight_steps: set[int]
) -> list[int]:
    """Delete committed steps beyond the newest ``keep_last``; never ``just_committed`` and
    never a step with a save in flight. Returns the steps deleted."""
    if keep_last is None:
        return []
    steps = await committed_steps(storage)
    doomed = [s for s in steps[:-keep_last] if s != just_committed and s not in in_flight_steps]
    for step in doomed:
        await remove_step(storage, step)
    return doomed


async def remove_everything(storage: Storage) -> list[int]:
    """Delete every committed step (newest first, each manifest before its data), then
    every leftover under the root, then the root folder itself where that means anything.
    The caller makes sure no save to ``storage`` is running. Returns the steps deleted."""
    steps = await committed_steps(storage)
    for step in reversed(steps):
        await remove_step(storage, step)
    for name in await storage.list_children(""):
        await storage.delete_prefix(name)
    await storage.remove_root()
    return steps
