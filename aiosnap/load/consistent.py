"""A load that holds while other processes change the root: another job's retention may
delete the very step being loaded (it committed a newer one), between the look-up of the
latest step and the reading of its manifest or of its data.

A read that fails on a missing or unreadable piece is judged by reading the step's manifest
again: still the one loaded (or there but unreadable), the checkpoint is damaged (the error
stands); gone or another save's, the step was removed meanwhile, which is no damage: a load
of the latest starts again from the new latest, and a load of an explicit step is told that
the step is not found any more. Runs on the background loop thread.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ..catalog.steps import LISTINGS, committed_save_id, manifest_of, not_committed
from ..core.names import manifest_name
from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..format.manifest import Manifest
from ..storage.base import Storage

__all__ = ["read_while_committed"]

log = logging.getLogger("aiosnap")
T = TypeVar("T")


async def read_while_committed(storage: Storage, step: int | None, read: Callable[[Manifest], Awaitable[T]]) -> T:
    """``read(manifest)`` of ``step`` (the latest committed step when None), started again
    with the new latest when the step read is removed meanwhile (at most
    :data:`~aiosnap.catalog.steps.LISTINGS` times)."""
    for _ in range(LISTINGS):
        manifest = await manifest_of(storage, step)
        try:
            return await read(manifest)
        except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
            if not await _removed_or_replaced(storage, manifest):
                raise  # the step is still committed as it was read (or damaged since): the failure is its own
            if step is not None:
                why = " any more: it was removed while this load read it (retention or a rollback elsewhere)"
                raise await not_committed(storage, step, why) from exc
            log.info("aiosnap: step %d was removed while it loaded; loading the latest step again", manifest.step)
    raise CheckpointNotFoundError(
        f"{storage.url}: the latest step was removed while it loaded, {LISTINGS} times in a row (another "
        "process's retention deletes steps faster than this load reads one: keep more steps there)"
    )


async def _removed_or_replaced(storage: Storage, manifest: Manifest) -> bool:
    """Whether ``manifest``'s step has no manifest any more, or another save's."""
    now = await committed_save_id(storage, manifest.step)
    if now is None:  # gone, or there but unreadable (damaged: not a removal)
        return not await storage.exists(manifest_name(manifest.step))
    return now != manifest.save_id
