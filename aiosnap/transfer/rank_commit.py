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
  coordinator gives up at once. Giving up, the coordinator writes the ``abort`` verdict
  first; after that no manifest of this save is ever written, and each rank removes its own
  folder. Data that might still be committed (a part delivered, no verdict yet) is never
  removed: it is left to ``aiosnap gc``, which leaves alone an attempt with a live heartbeat.

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
from ..core.names import attempt_prefix, manifest_name, object_prefix
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
from .commit import whose_commit
from .heartbeat import PeerWatch
from .verdict import claim_verdict, given_up, overrule_commit, read_verdict

__all__ = [
    "Reached",
    "check_objects",
    "deliver_part",
    "gather_manifest",
    "abandon_part",
    "give_up",
    "report_failure",
    "settle_rank",
    "settle_without_transfer",
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

Reached = Literal["uploading", "gathering", "claiming", "committing", "delivered"]
"""How far a rank's part of a save got: its upload; (coordinator) waiting for the parts,
claiming the commit verdict, writing the manifest; (other ranks) its part delivered."""


async def deliver_part(storage: Storage, spec: SaveSpec, crcs: Checksums) -> int:
    """Write this rank's part (after all its data objects); its size in bytes."""
    document = build_part(spec, crcs).to_json()
    await storage.write(part_name(spec.step, spec.save_id, spec.rank), document)
    return len(document)


def _reason(exc: BaseException, rank: int) -> bytes:
    return json.dumps({"rank": rank, "error": type(exc).__name__, "message": str(exc)[:1000]}).encode()


async def report_failure(storage: Storage, spec: SaveSpec, exc: BaseException) -> None:
    """Tell the coordinator this rank's part failed (best effort: else its heartbeat's end does)."""
    try:
        await storage.write(failed_name(spec.step, spec.save_id, spec.rank), _reason(exc, spec.rank))
    except Exception as error:
        log.warning("aiosnap: rank %d could not record its failed save of step %d: %r", spec.rank, spec.step, error)


async def give_up(storage: Storage, spec: SaveSpec, exc: BaseException, *, overrule: bool = False) -> bool:
    """Coordinator: make the verdict ``abort`` (before any data is removed). With
    ``overrule``, also over its own ``commit`` claim (its manifest was refused, or never
    written). Returns whether the save is now aborted (False: the store failed, or the
    commit claim stands)."""
    try:
        verdict = await claim_verdict(storage, spec, "abort", exc)
        if verdict.verdict == "commit" and overrule:
            await overrule_commit(storage, spec, exc)
            return True
        return verdict.verdict == "abort"
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


async def _exists(storage: Storage, name: str) -> bool:
    """Whether ``name`` exists; True when that cannot be told (the store failing)."""
    try:
        return await storage.exists(name)
    except Exception:
        return True


async def _is_aborted(storage: Storage, spec: SaveSpec) -> bool:
    try:
        found = await read_verdict(storage, spec)
    except Exception:
        return False
    return found is not None and found.verdict == "abort"


async def _remove_own_data(storage: Storage, spec: SaveSpec) -> None:
    """This rank's objects and part of a save that will never be committed (best effort)."""
    try:
        await storage.delete_prefix(object_prefix(spec.step, spec.save_id, spec.rank))
        await storage.delete(part_name(spec.step, spec.save_id, spec.rank))
    except Exception as exc:
        log.warning("aiosnap: rank %d left data of the failed step %d for gc: %r", spec.rank, spec.step, exc)


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


async def settle_rank(storage: Storage, spec: SaveSpec, exc: BaseException, reached: Reached, *, remove: bool) -> bool:
    """This rank's part of the save raised ``exc`` at ``reached``: True if the save committed
    after all. Otherwise leave the marker the others need (the coordinator the ``abort``
    verdict, another rank its failure) and, with ``remove``, this rank's own data once the
    save can no longer be committed (else it is left to ``aiosnap gc``)."""
    assert spec.distributed is not None
    coordinator = spec.distributed.coordinator == spec.rank
    own_part = part_name(spec.step, spec.save_id, spec.rank)
    if reached == "delivered" and storage.settled_writes and not await _exists(storage, own_part):
        reached = "uploading"  # its part never landed, and never will: the coordinator is told at once
    if reached in ("committing", "delivered"):  # the manifest, or our part, was being written
        # a refusal (another writer's manifest is there) is definite; anything else may have
        # been a request abandoned mid-way, which on an object store can still land
        interrupted = not isinstance(exc, FileExistsError)
        verdict = await whose_commit(storage, spec.step, spec.save_id, write_interrupted=interrupted)
        if verdict == "ours":
            return True
        aborted = False
        if coordinator and verdict == "other":  # its manifest was refused or never landed
            aborted = await give_up(storage, spec, exc, overrule=True)
        if not aborted and not await _is_aborted(storage, spec):
            log.warning("aiosnap: step %d (rank %d) may still be committed; its data is left for gc",
                        spec.step, spec.rank)  # fmt: skip
            return False
    elif coordinator:  # before its manifest write: no manifest of this save from now on
        if not await give_up(storage, spec, exc, overrule=reached == "claiming"):
            log.warning("aiosnap: step %d: no abort verdict could be written; rank %d's data is left for gc",
                        spec.step, spec.rank)  # fmt: skip
            return False
    else:
        await report_failure(storage, spec, exc)  # the coordinator gives up at once
    if remove:
        await _remove_own_data(storage, spec)
    return False


async def settle_without_transfer(
    storage: Storage, spec: SaveSpec, error: BaseException, config: DistributedConfig
) -> bool:
    """The upload process carrying this rank's part of the save died (trainer's loop thread):
    True if the save committed after all (or, having delivered its part, commits now), else
    the marker the others need is written, and :class:`RankFailedError` or ``error`` is
    raised. What the dead process left is read from storage."""
    assert spec.distributed is not None
    reached: Reached
    if spec.distributed.coordinator == spec.rank:
        # aborted now, unless the dead process claimed the commit (or the store fails)
        reached = "gathering" if await give_up(storage, spec, error) else "committing"
    elif await storage.exists(part_name(spec.step, spec.save_id, spec.rank)):
        reached = "delivered"
        try:
            await wait_for_commit(storage, spec, config)
            return True
        except RankFailedError:
            if storage.settled_writes:
                await _remove_own_data(storage, spec)
            raise
    else:
        reached = "uploading"
    # an abandoned write of the dead process may still land on an object store: leave its data
    if await settle_rank(storage, spec, error, reached, remove=storage.settled_writes):
        return True
    raise error
