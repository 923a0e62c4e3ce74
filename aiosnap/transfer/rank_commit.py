"""The commit of a multi-rank save, through storage only (loop thread or upload process).

No collective runs here: ranks learn about each other from objects in the attempt folder
(:mod:`aiosnap.format.markers`), and every way the save can end leaves one verdict there.

- Every rank writes its data objects, then its part (``rank-<r>.part.json``, :mod:`.parts`),
  with a heartbeat (:mod:`.heartbeat`) while its part is in flight.
- The coordinator (rank 0) waits for every part, bounded by ``commit_timeout`` from the end
  of its own upload, and names a rank whose heartbeat stopped after ``heartbeat_timeout``;
  reads and checks each part as it appears; merges them; checks that every object the merge
  names is in storage; claims the ``commit`` verdict; writes the step's manifest, by the same
  rules as a single-rank save (:mod:`aiosnap.transfer.commit`).
- The other ranks wait until the step's manifest names their save (committed), or the
  verdict is ``abort`` (:class:`RankFailedError` with its reason). They wait as long as the
  coordinator's heartbeat goes on (a slow coordinator is no failure); once it has stopped
  for ``heartbeat_timeout`` they declare the save aborted (if the coordinator has not
  claimed the commit first) and name it.
- A rank whose part fails before its part is written leaves ``rank-<r>.failed``: the
  coordinator gives up at once (settling a failed part: :mod:`.rank_settle`). Giving up, the
  coordinator writes the ``abort`` verdict first; after that no manifest of this save is ever
  written, and each rank removes its own folder. Data that might still be committed (a part
  delivered, no verdict yet) is never removed: it is left to ``aiosnap gc``, which leaves
  alone an attempt with a live heartbeat.

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
from typing import Literal

from ..catalog.steps import committed_save_id, latest_committed, read_manifest
from ..config import DistributedConfig
from ..core.aio import run_all
from ..core.names import attempt_prefix, manifest_name
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    RankFailedError,
    RankTimeoutError,
)
from ..format.manifest import Checksums, Manifest
from ..format.parts import RankPart, build_part, failed_name, merge_parts, part_name
from ..format.spec import SaveSpec
from ..storage.base import Storage
from .heartbeat import PeerWatch
from .verdict import claim_verdict, given_up, read_verdict

__all__ = ["GRACE_S", "Reached", "check_objects", "deliver_part", "gather_manifest", "wait_for_commit"]

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


async def deliver_part(storage: Storage, spec: SaveSpec, crcs: Checksums) -> int:
    """Write this rank's part (after all its data objects); its size in bytes."""
    document = build_part(spec, crcs).to_json()
    await storage.write(part_name(spec.step, spec.save_id, spec.rank), document)
    return len(document)


class _Backoff:
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


def _listed(ranks: list[int]) -> str:
    return f"{ranks[:16]}{' and more' if len(ranks) > 16 else ''}"


def _missing(world: int, have: set[int]) -> str:
    return _listed([r for r in range(world) if r not in have])


async def gather_manifest(storage: Storage, spec: SaveSpec, own: Checksums, config: DistributedConfig) -> Manifest:
    """Coordinator: every rank's part (its own from ``own``), merged into the step's
    manifest. :class:`RankFailedError` when a rank reports a failure (or a follower declared
    the save aborted); :class:`RankTimeoutError` naming the ranks whose heartbeat stopped, or
    those still missing after ``commit_timeout``."""
    assert spec.distributed is not None
    world, folder = spec.world_size, attempt_prefix(spec.step, spec.save_id)
    parts: dict[int, RankPart] = {spec.rank: build_part(spec, own)}
    backoff = _Backoff(time.monotonic() + spec.distributed.commit_timeout, world)
    watch = PeerWatch(storage, spec, config)
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
                f"step {spec.step}: rank(s) {_listed(stopped)} stopped before delivering their part of the save: no "
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
    except ValueError as exc:
        raise CorruptCheckpointError(f"step {spec.step}: the ranks' parts do not make one checkpoint: {exc}") from exc


async def check_objects(storage: Storage, manifest: Manifest) -> None:
    """Coordinator, before it claims the commit: every object ``manifest`` names is in
    storage, whole. :class:`RankFailedError` naming those that are not (``aiosnap gc``, or
    another tool, removed them): committing would make a step that cannot be loaded."""
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
            f"step {manifest.step}: {len(wrong)} object(s) of rank(s) {_listed(ranks)} are missing from {storage.url} "
            f"or not of their size ({names}): removed by `aiosnap gc` or another tool? Nothing was committed"
        )


async def _read_reason(storage: Storage, name: str) -> str:
    try:
        doc = json.loads(await storage.read(name, limit=8192))
        return f"{doc['error']}: {doc['message']}"[:1200] + f" (rank {int(doc['rank'])})"
    except Exception:
        return "(no reason recorded)"


async def _names_this_save(storage: Storage, spec: SaveSpec) -> bool:
    if not await storage.exists(manifest_name(spec.step)):
        return False
    try:
        return (await read_manifest(storage, spec.step)).save_id == spec.save_id
    except (CheckpointNotFoundError, CorruptCheckpointError):
        return False  # replaced or being replaced: look again


async def _committed_and_removed(storage: Storage, spec: SaveSpec) -> bool:
    """This rank's delivered part is gone: a commit removed it since (retention, or a re-save
    of the step), if a newer step is committed or the step's manifest is another save's.
    (``aiosnap gc`` leaves an attempt alone while a heartbeat is live or its verdict young.)"""
    if await storage.exists(part_name(spec.step, spec.save_id, spec.rank)):
        return False
    latest = await latest_committed(storage)
    if latest is not None and latest > spec.step:
        return True
    owner = await committed_save_id(storage, spec.step)
    return owner is not None and owner != spec.save_id


async def wait_for_commit(storage: Storage, spec: SaveSpec, config: DistributedConfig) -> None:
    """Non-coordinator, once its part is delivered: return when the step's manifest names this
    save (or it did, and a later commit already removed the step). :class:`RankFailedError`
    when the verdict is ``abort``, or when this rank finds the coordinator stopped and declares
    it; :class:`RankTimeoutError` when the verdict cannot be known (the coordinator stopped
    after claiming the commit, or said it was gathering parts longer than ``commit_timeout``
    plus :data:`GRACE_S`)."""
    assert spec.distributed is not None
    coordinator = spec.distributed.coordinator
    watch = PeerWatch(storage, spec, config)
    backoff = _Backoff(None, spec.world_size)
    deadline: float | None = None
    while True:
        if await _names_this_save(storage, spec):  # first: a manifest naming this save is the commit
            return
        verdict = await read_verdict(storage, spec)
        if verdict is not None and verdict.verdict == "abort":
            raise given_up(spec, verdict)
        stopped = await watch.stopped([coordinator])
        if stopped is not None:
            if await _committed_and_removed(storage, spec):
                log.info("aiosnap: step %d was committed, and removed by a later commit before rank %d saw it",
                         spec.step, spec.rank)  # fmt: skip
                return
            if stopped:
                await _coordinator_stopped(storage, spec, watch.silence(coordinator), config, verdict is not None)
                continue  # it claimed the commit meanwhile: its manifest follows
            if deadline is None and watch.phase(coordinator) == "gathering":
                deadline = time.monotonic() + spec.distributed.commit_timeout + GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            raise RankTimeoutError(
                f"step {spec.step}: the coordinator (rank {coordinator}) did not commit the save within commit_timeout "
                f"({spec.distributed.commit_timeout:g} s) plus {GRACE_S:g} s of gathering parts; this rank's data is "
                "left in place (the step may still be committed; `aiosnap gc` removes it otherwise)"
            )
        await backoff.sleep()


async def _coordinator_stopped(
    storage: Storage, spec: SaveSpec, silence: float, config: DistributedConfig, claimed: bool
) -> None:
    """The coordinator's heartbeat stopped: declare the save aborted (RankFailedError), unless
    it claimed the commit first (then nobody can tell: RankTimeoutError; if it returns, the
    claim appeared just now)."""
    assert spec.distributed is not None
    coordinator = spec.distributed.coordinator
    why = RankTimeoutError(
        f"step {spec.step}: the coordinator (rank {coordinator}) stopped: no heartbeat for {silence:.1f} s "
        f"(heartbeat_timeout {config.heartbeat_timeout:g} s); nothing was committed"
    )
    undecided = RankTimeoutError(
        f"step {spec.step}: the coordinator (rank {coordinator}) stopped (no heartbeat for {silence:.1f} s) after "
        "claiming the commit; this rank's data is left in place (the step may still be committed; `aiosnap gc` "
        "removes it otherwise)"
    )
    if claimed:
        raise undecided
    try:
        verdict = await claim_verdict(storage, spec, "abort", why)
    except Exception as exc:
        raise undecided from exc
    if verdict.verdict == "abort":
        raise why if verdict.rank == spec.rank else RankFailedError(f"{why} (declared by rank {verdict.rank})")
