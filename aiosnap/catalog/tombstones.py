"""Removing a committed attempt's data while its ranks may still look at it (whichever loop
calls it).

A follower of a multi-rank save learns that its save committed from the step's manifest;
when that step is removed before the follower looked (retention on the coordinator, or a
re-save replacing it), the manifest is gone. So the attempt's ``commit`` verdict is kept, as
the only object of its folder (a *tombstone*), for :data:`~aiosnap.format.markers.VERDICT_READ_S`:
a follower that finds its part gone beside a ``commit`` verdict knows its save committed
(:mod:`aiosnap.transfer.rank_wait`). The coordinator's transfer side removes its tombstones
once they are that old (:class:`Tombstones`); ``aiosnap gc`` removes those a process left.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..core.names import attempt_prefix, step_dir
from ..format.markers import VERDICT_FILE, VERDICT_READ_S
from ..storage.base import Storage

__all__ = ["Tombstones", "retire_attempt"]

log = logging.getLogger("aiosnap")


@dataclass
class Tombstones:
    """The verdicts of removed multi-rank attempts this process keeps for a while (loop
    thread of the transfer side)."""

    keep_s: float = VERDICT_READ_S
    _kept: list[tuple[float, str, int, str]] = field(default_factory=list)
    """(when, storage URL, step, save id), oldest first."""

    def add(self, storage: Storage, step: int, save_id: str) -> None:
        self._kept.append((time.monotonic(), storage.url, step, save_id))

    def __len__(self) -> int:
        return len(self._kept)

    async def sweep(self, storage: Storage) -> None:
        """Remove the tombstones under ``storage`` older than :attr:`keep_s` (best effort:
        ``aiosnap gc`` removes any left)."""
        now = time.monotonic()
        due = [t for t in self._kept if t[1] == storage.url and now - t[0] >= self.keep_s]
        for kept in due:
            self._kept.remove(kept)
            _, _, step, save_id = kept
            try:
                await storage.delete(f"{attempt_prefix(step, save_id)}/{VERDICT_FILE}")
                await storage.remove_empty_folder(attempt_prefix(step, save_id))
                await storage.remove_empty_folder(step_dir(step))
            except Exception as exc:
                log.debug("aiosnap: removing the kept verdict of step %d failed (left for gc): %r", step, exc)


async def retire_attempt(storage: Storage, step: int, save_id: str, tombstones: Tombstones | None = None) -> None:
    """Delete the attempt ``save_id`` of ``step`` (its manifest is already gone or replaced).
    With ``tombstones``, a multi-rank attempt's verdict stays (and is recorded there)."""
    prefix = attempt_prefix(step, save_id)
    if tombstones is None or VERDICT_FILE not in await storage.list_children(prefix):
        await storage.delete_prefix(prefix)
        return
    verdict = f"{prefix}/{VERDICT_FILE}"
    try:
        names = [o.name for o in await storage.walk(prefix) if o.name != verdict]
    except NotImplementedError:  # a backend that cannot list: no tombstone
        await storage.delete_prefix(prefix)
        return
    await storage.delete_many(names)
    for child in await storage.list_children(prefix):  # the folders the data left (local disk)
        if child != VERDICT_FILE:
            await storage.remove_empty_folder(f"{prefix}/{child}")
    tombstones.add(storage, step, save_id)
