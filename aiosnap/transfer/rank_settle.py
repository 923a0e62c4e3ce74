"""Settling a rank's part of a multi-rank save that failed (loop thread or upload process;
after an upload process died, the trainer's loop thread).

Whatever failed, the other ranks are told through storage (:mod:`.rank_commit`): the
coordinator makes the verdict ``abort``, another rank leaves ``rank-<r>.failed`` (or, its part
delivered, waits for the verdict, which the coordinator may still make ``commit``). A rank
removes its own data only once the save can no longer be committed; data that might still be
committed is left for ``aiosnap gc``.
"""

from __future__ import annotations

import asyncio
import json
import logging

from ..config import DistributedConfig
from ..core.names import object_prefix
from ..errors import RankFailedError, RankTimeoutError
from ..format.parts import failed_name, part_name
from ..format.spec import SaveSpec
from ..storage.base import Storage
from .commit import whose_commit
from .rank_commit import Reached
from .rank_wait import wait_for_commit
from .verdict import claim_verdict, overrule_commit, read_verdict

__all__ = ["abandon_part", "give_up", "report_failure", "settle_rank", "settle_without_transfer"]

log = logging.getLogger("aiosnap")


def _reason(exc: BaseException, rank: int) -> bytes:
    return json.dumps({"rank": rank, "error": type(exc).__name__, "message": str(exc)[:1000]}).encode()


async def report_failure(storage: Storage, spec: SaveSpec, exc: BaseException) -> None:
    """Tell the coordinator this rank's part failed (best effort: else its heartbeat's end does)."""
    try:
        await storage.write_marker(failed_name(spec.step, spec.save_id, spec.rank), _reason(exc, spec.rank))
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


async def _retired(storage: Storage, spec: SaveSpec) -> bool:
    """This rank's part is gone beside a ``commit`` verdict (which needs every part): the
    save committed, and retention or a re-save removed it since."""
    try:
        found = await read_verdict(storage, spec)
    except Exception:
        return False
    return found is not None and found.verdict == "commit"


async def _remove_own_data(storage: Storage, spec: SaveSpec) -> None:
    """This rank's objects and part of a save that will never be committed (best effort)."""
    try:
        await storage.delete_prefix(object_prefix(spec.step, spec.save_id, spec.rank))
        await storage.delete(part_name(spec.step, spec.save_id, spec.rank))
    except Exception as exc:
        log.warning("aiosnap: rank %d left data of the failed step %d for gc: %r", spec.rank, spec.step, exc)


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
    storage: Storage, spec: SaveSpec, error: BaseException, config: DistributedConfig, *, wait_s: float | None = None
) -> bool:
    """The upload process carrying this rank's part of the save died (trainer's loop thread):
    True if the save committed after all (or, having delivered its part, commits now), else
    the marker the others need is written, and :class:`RankFailedError` or ``error`` is
    raised. What the dead process left is read from storage. ``wait_s`` bounds the wait for
    the verdict of a delivered part (``close(timeout)`` killed the process): past it,
    :class:`RankTimeoutError` says the step may still be committed."""
    assert spec.distributed is not None
    reached: Reached
    if spec.distributed.coordinator == spec.rank:
        # aborted now, unless the dead process claimed the commit (or the store fails)
        reached = "gathering" if await give_up(storage, spec, error) else "committing"
    elif await storage.exists(part_name(spec.step, spec.save_id, spec.rank)):
        reached = "delivered"
        try:
            async with asyncio.timeout(wait_s) as bound:
                await wait_for_commit(storage, spec, config)
            return True
        except TimeoutError as exc:
            if not bound.expired():
                raise  # wait_for_commit's own RankTimeoutError
            raise RankTimeoutError(
                f"step {spec.step}: this rank's part was delivered, and close() stopped waiting for the save's verdict "
                f"after {wait_s:g} s: the step may still be committed by the coordinator (see `aiosnap ls`); this "
                "rank's data is left in place"
            ) from exc
        except RankFailedError:
            if storage.settled_writes:
                await _remove_own_data(storage, spec)
            raise
    elif await _retired(storage, spec):
        return True  # committed, and already removed by a later commit (its verdict kept)
    else:
        reached = "uploading"
    # an abandoned write of the dead process may still land on an object store: leave its data
    if await settle_rank(storage, spec, error, reached, remove=storage.settled_writes):
        return True
    raise error
