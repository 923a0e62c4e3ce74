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

Nothing here deletes another attempt's folder, except the one a re-save replaced. The
commit point itself (:func:`commit_manifest`, :func:`whose_commit`) lives in
:mod:`aiosnap.catalog.commit`, where the converters' imports (``interop``) reach it too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..catalog.commit import (
    READ_BACK_TIMEOUT_S,
    checked_document,
    commit_manifest,
    remove_replaced,
    whose_commit,
    write_manifest,
)
from ..catalog.steps import latest_committed
from ..core.names import attempt_prefix, step_dir
from ..errors import StepOrderError
from ..storage.base import Storage

__all__ = [
    "READ_BACK_TIMEOUT_S", "Preflight", "checked_document", "commit_manifest", "preflight", "remove_attempt",
    "remove_replaced", "whose_commit", "write_manifest",
]  # fmt: skip

log = logging.getLogger("aiosnap")


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


async def remove_attempt(storage: Storage, step: int, save_id: str) -> None:
    """Best-effort removal of one failed attempt's folder (this process's own)."""
    try:
        await storage.delete_prefix(attempt_prefix(step, save_id))
        await storage.remove_empty_folder(step_dir(step))
    except Exception as exc:  # cleanup must not hide the failure that got us here
        log.warning("aiosnap: could not remove data of failed save at step %d (left for gc): %r", step, exc)
