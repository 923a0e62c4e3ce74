"""The commit of a multi-rank save, through storage only (loop thread or upload process):
the coordinator's side (the other ranks wait in :mod:`.rank_wait`).

No collective runs here: ranks learn about each other from objects in the attempt folder
(:mod:`aiosnap.format.markers`), and every way the save can end leaves one verdict there.

- Every rank writes its data objects, then its part (``rank-<r>.part.json``, :mod:`.parts`),
  with a heartbeat (:mod:`.heartbeat`) while its part is in flight.
- The coordinator (rank 0) waits for every part, bounded by ``commit_timeout`` from the end
  of its own upload, and names a rank whose heartbeat stopped after ``heartbeat_timeout``;
  reads and checks each part as it appears; merges them; checks that every object the merge
  names is in storage; serializes the manifest; claims the ``commit`` verdict; writes the
  step's manifest, by the same rules as a single-rank save (:mod:`aiosnap.transfer.commit`);
  then checks that the commit stands (:func:`commit_claimed`: its claim still in force,
  every object still there: a coordinator held up after its claim may find them removed),
  and only then removes what the manifest replaced and lets retention run. A commit that
  does not stand is taken back (the manifest removed, or the replaced one restored) and the
  verdict becomes ``abort``.
- A rank whose part fails before its part is written leaves ``rank-<r>.failed``: the
  coordinator gives up at once (settling a failed part: :mod:`.rank_settle`). Giving up, the
  coordinator writes the ``abort`` verdict first; after that no manifest of this save is ever
  written, and each rank removes its own folder. Data that might still be committed (a part
  delivered, no verdict yet) is never removed: it is left to ``aiosnap gc``, which leaves
  alone an attempt with a live heartbeat or a standing ``commit`` claim.

Requests grow linearly with ranks: each rank writes one part and a heartbeat per interval
and polls two small objects with backoff; the coordinator lists the attempt folder per poll,
reads each part once and the heartbeats of the ranks still missing once per interval.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Sequence
from typing import Literal

from ..catalog.steps import committed_document
from ..catalog.tombstones import Tombstones
from ..config import DistributedConfig
from ..core.aio import run_all
from ..core.names import attempt_prefix, manifest_name
from ..errors import (
    CorruptCheckpointError,
    RankFailedError,
    RanksDisagreeError,
    RankTimeoutError,
)
from ..format.manifest import Checksums, Manifest
from ..format.merge import merge_parts
from ..format.parts import MAX_PART_BYTES, RankPart, build_part, failed_name, part_name
from ..format.placement import Landing
from ..format.spec import SaveSpec
from ..storage.base import Storage
from .commit import remove_replaced, write_manifest
from .heartbeat import PeerWatch
from .verdict import given_up, overrule_commit, read_verdict

__all__ = ["GRACE_S", "Backoff", "Reached", "check_objects", "commit_claimed", "deliver_part", "gather_manifest"]

log = logging.getLogger("aiosnap")

FIRST_POLL_S = 0.005
LAST_POLL_S = 0.25
POLL_S_PER_RANK = 0.001
"""The slowest poll waits the larger of :data:`LAST_POLL_S` and this per rank of the job,
so that all ranks together poll a store at most about a thousand times a second."""
GRACE_S = 5.0
"""Non-coordinators wait this much longer than the coordinator, so its verdict arrives first."""
_READS_AT_ONCE = 16

Reached = Literal["uploading", "gathering", "claiming", "committing", "delivered"]
"""How far a rank's part of a save got: its upload; (coordinator) waiting for the parts,
claiming the commit verdict, writing the manifest; (other ranks) its part delivered."""


async def deliver_part(
    storage: Storage, spec: SaveSpec, crcs: Checksums, landings: Sequence[Landing] | None = None
) -> int:
    """Write this rank's part (after all its data objects; ``landings``: where an
    incremental save's pieces landed); its size in bytes."""
    document = build_part(spec, crcs, landings).to_json()
    await storage.write(part_name(spec.step, spec.save_id, spec.rank), document)
    return len(document)


class Backoff:
    """Polls from every few milliseconds (a commit lands moments after the last part) to
    every :data:`LAST_POLL_S` (or more in large jobs), with jitter."""

    def __init__(self, deadline: float | None, world_size: int) -> None:
        self.deadline = deadline
        self.delay = FIRST_POLL_S
        self.longest = max(LAST_POLL_S, world_size * POLL_S_PER_RANK)

    async def sleep(self) -> bool:
        """Wait before the next poll; False once the deadline has passed."""
        left = float("inf") if self.deadline is None else self.deadline - time.monotonic()
        if left <= 0:
            return False
        jitter = random.uniform(0.8, 1.2)  # noqa: S311 - spreads polls, not a secret
        await asyncio.sleep(min(self.delay * jitter, left))
        self.delay = min(self.delay * 1.3, self.longest)
        return True


def listed(ranks: list[int]) -> str:
    return f"{ranks[:16]}{' and more' if len(ranks) > 16 else ''}"


def _missing(world: int, have: set[int]) -> str:
    return listed([r for r in range(world) if r not in have])


async def gather_manifest(
    storage: Storage,
    spec: SaveSpec,
    own: Checksums,
    config: DistributedConfig,
    landings: Sequence[Landing] | None = None,
) -> Manifest:
    """Coordinator: every rank's part (its own from ``own`` and ``landings``), merged into the step's
    manifest. :class:`RankFailedError` when a rank reports a failure (or a follower declared
    the save aborted); :class:`RankTimeoutError` naming the ranks whose heartbeat stopped, or
    those still missing after ``commit_timeout``."""
    assert spec.distributed is not None
    world, folder = spec.world_size, attempt_prefix(spec.step, spec.save_id)
    parts: dict[int, RankPart] = {spec.rank: build_part(spec, own, landings)}
    backoff = Backoff(time.monotonic() + spec.distributed.commit_timeout, world)
    watch = PeerWatch(storage, spec, config)
    limit = asyncio.Semaphore(_READS_AT_ONCE)

    async def read(rank: int) -> None:
        name = part_name(spec.step, spec.save_id, rank)
        async with limit:
            data = await storage.read(name, limit=MAX_PART_BYTES)
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
        if "verdict" in names:
            found = await read_verdict(storage, spec)
            if found is not None and found.verdict == "abort":
                raise given_up(spec, found)
        new = [r for r in range(world) if r not in parts and f"rank-{r}.part.json" in names]
        await run_all(read(rank) for rank in new)
        if len(parts) == world:
            break
        stopped = await watch.stopped(r for r in range(world) if r not in parts)
        if stopped:
            raise RankTimeoutError(
                f"step {spec.step}: rank(s) {listed(stopped)} stopped before delivering their part of the save: no "
                f"heartbeat for {watch.silence(stopped[0]):.1f} s (heartbeat_timeout "
                f"{config.heartbeat_timeout:g} s); nothing was committed"
            )
        if not await backoff.sleep():
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


async def check_objects(storage: Storage, manifest: Manifest) -> None:
    """Coordinator, before it claims the commit and once its manifest is written: every
    object ``manifest`` names is in storage, whole. :class:`RankFailedError` naming those
    that are not (``aiosnap gc``, or another tool, removed them): committing would make a
    step that cannot be loaded."""
    try:
        stored = {o.name: o.size for o in await storage.walk(attempt_prefix(manifest.step, manifest.save_id))}
    except NotImplementedError:
        stored = {}
        limit = asyncio.Semaphore(_READS_AT_ONCE)

        async def size(name: str) -> None:
            try:
                async with limit:
                    stored[name] = await storage.size(name)
            except FileNotFoundError:
                pass

        await run_all(size(o.name) for o in manifest.objects)
    wrong = [o for o in manifest.objects if stored.get(o.name) != o.nbytes]
    if wrong:
        names = ", ".join(o.name for o in wrong[:5]) + (" ..." if len(wrong) > 5 else "")
        ranks = sorted({o.rank for o in wrong})
        raise RankFailedError(
            f"step {manifest.step}: {len(wrong)} object(s) of rank(s) {listed(ranks)} are missing from {storage.url} "
            f"or not of their size ({names}): removed by `aiosnap gc` or another tool? Nothing was committed"
        )


async def commit_claimed(
    storage: Storage,
    spec: SaveSpec,
    manifest: Manifest,
    document: bytes,
    *,
    replace: bool,
    tombstones: Tombstones | None = None,
) -> int:
    """Coordinator, its ``commit`` claimed: write ``document`` (``manifest`` as JSON) as the
    step's manifest, then check that the commit stands before anything relies on it: the
    verdict is still its own ``commit``, and every object the manifest names is there,
    whole. A coordinator held up after its claim (a paused machine, a stalled loop) may find
    them gone (``aiosnap gc``, another tool). Only then is the attempt a re-save replaced
    removed (keeping its verdict a while, in ``tombstones``) and may retention run. A commit
    that does not stand is taken back (the manifest removed, or the one it replaced written
    back), the verdict becomes ``abort``, and :class:`RankFailedError` says why. Returns the
    manifest's size."""
    replaced = await write_manifest(storage, manifest, document, replace=replace)
    problem = await _commit_fails(storage, spec, manifest)
    if problem is not None:
        await _take_back(storage, manifest, None if replaced is None else replaced[1])
        await overrule_commit(storage, spec, problem)
        raise problem
    if replaced is not None:
        await remove_replaced(storage, manifest, replaced[0], tombstones, old_document=replaced[1])
    return len(document)


async def _commit_fails(storage: Storage, spec: SaveSpec, manifest: Manifest) -> RankFailedError | None:
    """Why the commit just written does not stand (None: it does)."""
    verdict = await read_verdict(storage, spec)
    if verdict is None or verdict.verdict != "commit" or verdict.rank != spec.rank:
        why = "is gone" if verdict is None else f"was overruled by rank {verdict.rank}: {verdict.reason}"
        return RankFailedError(
            f"step {spec.step}: this rank's commit claim {why} by the time its manifest was written (it was held up "
            "after claiming); the manifest is taken back: nothing was committed"
        )
    try:
        await check_objects(storage, manifest)
    except RankFailedError as exc:
        return RankFailedError(
            f"{exc}, although they were there when the commit was claimed (this rank was held up after its claim): "
            "the manifest is taken back"
        )
    return None


async def _take_back(storage: Storage, manifest: Manifest, replaced: bytes | None) -> None:
    """Remove the manifest just written (or write back the one it replaced), if the step's
    manifest is still this save's."""
    name = manifest_name(manifest.step)
    try:
        found = await committed_document(storage, manifest.step)
        if found is None or found[1] != manifest.save_id:
            return  # not ours any more: another writer's, left alone
        if replaced is None:
            await storage.delete(name)
        else:
            await storage.write(name, replaced)
    except Exception as exc:
        log.error("aiosnap: step %d: could not take back a manifest naming missing objects: %r", manifest.step, exc)


async def _read_reason(storage: Storage, name: str) -> str:
    try:
        doc = json.loads(await storage.read(name, limit=8192))
        return f"{doc['error']}: {doc['message']}"[:1200] + f" (rank {int(doc['rank'])})"
    except Exception:
        return "(no reason recorded)"
