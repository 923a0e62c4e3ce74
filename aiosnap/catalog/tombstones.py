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

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Set
from dataclasses import dataclass, field

from ..core.names import attempt_prefix, step_dir
from ..format.markers import VERDICT_FILE, VERDICT_READ_S
from ..storage.base import Storage
from .keep import KeptNames

__all__ = ["Keep", "Tombstones", "retire_attempt"]

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


Keep = Callable[[], Awaitable[Set[str]]]
"""Asked after an attempt folder is listed: the objects in it that must stay (see
:mod:`.keep`)."""


async def retire_attempt(
    storage: Storage,
    step: int,
    save_id: str,
    tombstones: Tombstones | None = None,
    keep: Keep | None = None,
    listed: list[str] | None = None,
) -> list[str]:
    """Delete the attempt ``save_id`` of ``step`` (its manifest is already gone or replaced).
    With ``tombstones``, a multi-rank attempt's verdict stays (and is recorded there). With
    ``keep``, the folder is listed first, then ``keep()`` asked (mark after list), and the
    objects it names stay where they are (other steps' manifests name them); ``listed``: the
    folder's objects as the caller listed them before it asked ``keep()`` itself. Returns the
    objects left in the folder for that reason."""
    prefix = attempt_prefix(step, save_id)
    children = await storage.list_children(prefix) if tombstones is not None or keep is not None else []
    with_verdict = tombstones is not None and VERDICT_FILE in children
    if keep is None and not with_verdict:
        await storage.delete_prefix(prefix)
        return []
    verdict = f"{prefix}/{VERDICT_FILE}"
    if listed is None:
        with contextlib.suppress(NotImplementedError):  # a backend that cannot list: no tombstone
            listed = [o.name for o in await storage.walk(prefix)]
    kept = frozenset() if keep is None else await keep()
    if listed is None:
        if keep is None or not _holds_under(kept, prefix):
            await storage.delete_prefix(prefix)
        else:
            log.warning("aiosnap: %s cannot list %s, which holds referenced objects: left whole", storage.url, prefix)
            return [name for name in kept if name.startswith(prefix + "/")] or [prefix + "/"]
        return []
    held = [name for name in listed if name in kept]
    if not held and not with_verdict:
        await storage.delete_prefix(prefix)
        return []
    await storage.delete_many([name for name in listed if name not in kept and not (with_verdict and name == verdict)])
    for child in await storage.list_children(prefix):  # the folders the data left (local disk)
        if child != VERDICT_FILE:
            await storage.remove_empty_folder(f"{prefix}/{child}")
    if with_verdict:
        assert tombstones is not None
        tombstones.add(storage, step, save_id)
    return held


def _holds_under(kept: Set[str], prefix: str) -> bool:
    """Whether ``kept`` keeps an object under the folder ``prefix``."""
    if isinstance(kept, KeptNames):
        return kept.holds_under(prefix)
    return any(name.startswith(prefix + "/") for name in kept)
