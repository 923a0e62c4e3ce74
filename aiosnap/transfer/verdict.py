"""The one verdict of a multi-rank save, in storage (loop thread or upload process).

``<step>/<save id>/verdict`` is written only if absent (see :mod:`aiosnap.format.markers`),
so of the coordinator claiming the commit and a follower declaring a stopped coordinator's
save aborted, exactly one wins, and every rank reads the same answer. A multi-rank save
needs a store where that holds (:attr:`~aiosnap.storage.base.Storage.conditional_writes`;
on S3 ``s3.conditional_commit``): without it, checkpointers refuse to be made.
"""

from __future__ import annotations

import logging
from typing import Literal

from ..errors import CorruptCheckpointError, RankFailedError, RanksDisagreeError
from ..format.markers import MAX_VERDICT_BYTES, Verdict, verdict_name
from ..format.spec import SaveSpec
from ..storage.base import Storage

__all__ = ["claim_verdict", "given_up", "overrule_commit", "read_verdict"]

log = logging.getLogger("aiosnap")


def _verdict(spec: SaveSpec, kind: Literal["commit", "abort"], exc: BaseException | None) -> Verdict:
    return Verdict(
        verdict=kind,
        save_id=spec.save_id,
        rank=spec.rank,
        error="" if exc is None else type(exc).__name__[:200],
        message="" if exc is None else str(exc)[:1000],
    )


async def read_verdict(storage: Storage, spec: SaveSpec) -> Verdict | None:
    """The save's verdict; None while there is none. A verdict object that is not one
    (damaged) or of another save counts as an abort: nobody can commit against it."""
    try:
        data = await storage.read(verdict_name(spec.step, spec.save_id), limit=MAX_VERDICT_BYTES)
    except FileNotFoundError:
        return None
    found = Verdict.from_json(data)
    if found is None or found.save_id != spec.save_id:
        return Verdict(verdict="abort", save_id=spec.save_id, rank=spec.rank, error="ManifestError",
                       message="the save's verdict object is damaged")  # fmt: skip
    return found


async def claim_verdict(
    storage: Storage, spec: SaveSpec, kind: Literal["commit", "abort"], exc: BaseException | None = None
) -> Verdict:
    """Write this rank's verdict unless there is one already; the verdict in force (this
    one, or the one found). Storage errors are raised (the verdict is then unknown)."""
    mine = _verdict(spec, kind, exc)
    name = verdict_name(spec.step, spec.save_id)
    for _ in range(3):
        try:
            await storage.write_marker(name, mine.to_json(), if_absent=True)
            return mine
        except FileExistsError:
            found = await read_verdict(storage, spec)
            if found is not None:
                return found
    raise FileNotFoundError(f"{storage.url}/{name}: the verdict exists, and is gone when read, again and again")


async def overrule_commit(storage: Storage, spec: SaveSpec, exc: BaseException) -> None:
    """Coordinator only: its own ``commit`` claim becomes ``abort``, because its manifest was
    refused or never written (only the claimer may replace the verdict)."""
    await storage.write_marker(verdict_name(spec.step, spec.save_id), _verdict(spec, "abort", exc).to_json())


_MERGE_VERDICTS: dict[str, type[Exception]] = {
    "RanksDisagreeError": RanksDisagreeError,
    "CorruptCheckpointError": CorruptCheckpointError,
    "ManifestError": CorruptCheckpointError,  # a part that is no part (as the coordinator saw it)
}
"""Errors of the coordinator's merge, about every rank's parts together: each rank raises
them with their own type, as the coordinator does; any other reason is a RankFailedError."""


def given_up(spec: SaveSpec, verdict: Verdict) -> Exception:
    """What a rank raises on reading the ``abort`` verdict ``verdict``."""
    kind = _MERGE_VERDICTS.get(verdict.error, RankFailedError)
    return kind(f"step {spec.step}: the save was given up by rank {verdict.rank}: {verdict.reason}")
