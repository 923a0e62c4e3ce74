"""The commit of a multi-rank save, through storage only (loop thread or upload process).

No collective runs here: ranks learn about each other from objects in the attempt folder.

- Every rank writes its data objects, then its part (``rank-<r>.part.json``, :mod:`.parts`).
- The coordinator (rank 0) waits for every part, bounded by ``commit_timeout``; reads and
  checks each as it appears; merges them; writes the step's manifest: the commit point,
  by the same rules as a single-rank save (:mod:`aiosnap.transfer.commit`).
- The other ranks wait (``commit_timeout`` plus a grace, so the coordinator's verdict comes
  first) until the step's manifest names their save (committed), or the coordinator's
  ``aborted`` marker appears (:class:`RankFailedError` with its reason).
- A rank whose part fails before its part is written leaves ``rank-<r>.failed`` (best
  effort): the coordinator gives up at once instead of waiting for the timeout. Giving up,
  the coordinator writes ``aborted`` first; after that no manifest of this save is ever
  written, and each rank removes its own folder. Data that might still be committed (a
  part delivered, no verdict yet) is never removed: it is left to ``aiosnap gc``.

Requests grow linearly with ranks: each rank writes one part and polls two small objects
with backoff; the coordinator lists the attempt folder per poll and reads each part once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from typing import Literal

from ..catalog.steps import read_manifest
from ..core.aio import run_all
from ..core.names import attempt_prefix, manifest_name, object_prefix
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    RankFailedError,
    RanksDisagreeError,
    RankTimeoutError,
)
from ..format.manifest import Checksums, Manifest
from ..format.merge import merge_parts
from ..format.parts import RankPart, aborted_name, build_part, failed_name, part_name
from ..format.spec import SaveSpec
from ..storage.base import Storage

__all__ = [
    "abandon_part",
    "deliver_part",
    "gather_manifest",
    "give_up",
    "is_aborted",
    "remove_own_data",
    "report_failure",
    "wait_for_commit",
]

log = logging.getLogger("aiosnap")

FIRST_POLL_S = 0.005
LAST_POLL_S = 0.25
POLL_S_PER_RANK = 0.001
"""The slowest poll waits the larger of :data:`LAST_POLL_S` and this per rank of the job,
so that all ranks together poll a store at most about a thousand times a second."""
GRACE_S = 5.0
"""Non-coordinators wait this much longer than the coordinator, so its verdict arrives first."""
_READS_AT_ONCE = 16


async def deliver_part(storage: Storage, spec: SaveSpec, crcs: Checksums) -> int:
    """Write this rank's part (after all its data objects); its size in bytes."""
    document = build_part(spec, crcs).to_json()
    await storage.write(part_name(spec.step, spec.save_id, spec.rank), document)
    return len(document)


def _reason(exc: BaseException, rank: int) -> bytes:
    return json.dumps({"rank": rank, "error": type(exc).__name__, "message": str(exc)[:1000]}).encode()


async def report_failure(storage: Storage, spec: SaveSpec, exc: BaseException) -> None:
    """Tell the coordinator this rank's part failed (best effort: else it times out)."""
    try:
        await storage.write(failed_name(spec.step, spec.save_id, spec.rank), _reason(exc, spec.rank))
    except Exception as error:
        log.warning("aiosnap: rank %d could not record its failed save of step %d: %r", spec.rank, spec.step, error)


async def give_up(storage: Storage, spec: SaveSpec, exc: BaseException) -> bool:
    """Coordinator: record that this save will never be committed (before any data is
    removed). Returns whether the marker was written."""
    try:
        await storage.write(aborted_name(spec.step, spec.save_id), _reason(exc, spec.rank))
        return True
    except Exception as error:
        log.warning("aiosnap: could not mark the failed save of step %d as aborted: %r", spec.step, error)
        return False


async def abandon_part(storage: Storage, spec: SaveSpec, exc: BaseException) -> None:
    """This rank's save failed before its transfer could settle it (``save()`` itself
    raised): the coordinator gives up, any other rank reports its failure."""
    assert spec.distributed is not None
    if spec.distributed.coordinator == spec.rank:
        await give_up(storage, spec, exc)
    else:
        await report_failure(storage, spec, exc)


async def is_aborted(storage: Storage, spec: SaveSpec) -> bool:
    try:
        return await storage.exists(aborted_name(spec.step, spec.save_id))
    except Exception:
        return False


async def remove_own_data(storage: Storage, spec: SaveSpec) -> None:
    """This rank's objects and part of a save that will never be committed (best effort)."""
    try:
        await storage.delete_prefix(object_prefix(spec.step, spec.save_id, spec.rank))
        await storage.delete(part_name(spec.step, spec.save_id, spec.rank))
    except Exception as exc:
        log.warning("aiosnap: rank %d left data of the failed step %d for gc: %r", spec.rank, spec.step, exc)


class _Backoff:
    """Polls from every few milliseconds (a commit lands moments after the last part) to
    every :data:`LAST_POLL_S` (or more in large jobs), with jitter."""

    def __init__(self, deadline: float, world_size: int) -> None:
        self.deadline = deadline
        self.delay = FIRST_POLL_S
        self.longest = max(LAST_POLL_S, world_size * POLL_S_PER_RANK)

    async def sleep(self) -> bool:
        """Wait before the next poll; False once the deadline has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            return False
        jitter = random.uniform(0.8, 1.2)  # noqa: S311 - spreads polls, not a secret
        await asyncio.sleep(min(self.delay * jitter, left))
        self.delay = min(self.delay * 1.3, self.longest)
        return True


def _missing(world: int, have: set[int]) -> str:
    missing = [r for r in range(world) if r not in have]
    return f"{missing[:16]}{' and more' if len(missing) > 16 else ''}"


async def gather_manifest(storage: Storage, spec: SaveSpec, own: Checksums) -> Manifest:
    """Coordinator: every rank's part (its own from ``own``), merged into the step's
    manifest. :class:`RankFailedError` when a rank reports a failure,
    :class:`RankTimeoutError` naming the ranks missing after ``commit_timeout``."""
    assert spec.distributed is not None
    world, folder = spec.world_size, attempt_prefix(spec.step, spec.save_id)
    parts: dict[int, RankPart] = {spec.rank: build_part(spec, own)}
    backoff = _Backoff(time.monotonic() + spec.distributed.commit_timeout, world)
    limit = asyncio.Semaphore(_READS_AT_ONCE)

    async def read(rank: int) -> None:
        name = part_name(spec.step, spec.save_id, rank)
        async with limit:
            data = await storage.read(name)
        part = RankPart.from_json(data, where=f"{storage.url}/{name}")
        if part.rank != rank:
            raise CorruptCheckpointError(f"{storage.url}/{name}: a part of rank {part.rank}")
        parts[rank] = part

    while len(parts) < world:
        names = set(await storage.list_children(folder))
        failed = sorted(r for r in range(world) if f"rank-{r}.failed" in names)
        if failed:
            reason = await _read_reason(storage, failed_name(spec.step, spec.save_id, failed[0]))
            raise RankFailedError(f"step {spec.step}: rank(s) {failed} failed their part of the save: {reason}")
        new = [r for r in range(world) if r not in parts and f"rank-{r}.part.json" in names]
        await run_all(read(rank) for rank in new)
        if len(parts) < world and not await backoff.sleep():
            raise RankTimeoutError(
                f"step {spec.step}: rank(s) {_missing(world, set(parts))} did not deliver their part of the save "
                f"within commit_timeout ({spec.distributed.commit_timeout:g} s); nothing was committed"
            )
    try:
        return merge_parts(spec, parts)
    except RanksDisagreeError:
        raise  # ranks hold one path in two layouts: every rank is told so (see wait_for_commit)
    except ValueError as exc:
        raise CorruptCheckpointError(f"step {spec.step}: the ranks' parts do not make one checkpoint: {exc}") from exc


async def _read_reason(storage: Storage, name: str) -> str:
    try:
        doc = json.loads(await storage.read(name, limit=8192))
        return f"{doc['error']}: {doc['message']}"[:1200] + f" (rank {int(doc['rank'])})"
    except Exception:
        return "(no reason recorded)"


_MERGE_VERDICTS: dict[str, type[Exception]] = {
    "RanksDisagreeError": RanksDisagreeError,
    "CorruptCheckpointError": CorruptCheckpointError,
    "ManifestError": CorruptCheckpointError,  # a part that is no part (as the coordinator saw it)
}
"""Errors of the coordinator's merge, about every rank's parts together: each rank raises
them with their own type, as the coordinator does."""


def _verdict(reason: str) -> type[Exception]:
    """The error type other ranks raise for the coordinator's recorded ``reason``."""
    return _MERGE_VERDICTS.get(reason.split(":", 1)[0], RankFailedError)


async def wait_for_commit(storage: Storage, spec: SaveSpec) -> Literal["ours"]:
    """Non-coordinator: wait until the step's manifest names this save. :class:`RankFailedError`
    when the coordinator gives up; :class:`RankTimeoutError` when nothing is decided in time."""
    assert spec.distributed is not None
    backoff = _Backoff(time.monotonic() + spec.distributed.commit_timeout + GRACE_S, spec.world_size)
    name = manifest_name(spec.step)
    while True:
        if await storage.exists(name):  # first: a manifest naming this save is the commit, marker or not
            try:
                if (await read_manifest(storage, spec.step)).save_id == spec.save_id:
                    return "ours"
            except (CheckpointNotFoundError, CorruptCheckpointError):
                pass  # replaced or being replaced: look again
        if await storage.exists(aborted_name(spec.step, spec.save_id)):
            reason = await _read_reason(storage, aborted_name(spec.step, spec.save_id))
            raise _verdict(reason)(f"step {spec.step}: the coordinator gave the save up: {reason}")
        if not await backoff.sleep():
            raise RankTimeoutError(
                f"step {spec.step}: the coordinator (rank {spec.distributed.coordinator}) did not commit the save "
                f"within commit_timeout ({spec.distributed.commit_timeout:g} s) plus {GRACE_S:g} s; this rank's "
                "data is left in place (the step may still be committed; `aiosnap gc` removes it otherwise)"
            )
