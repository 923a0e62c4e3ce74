"""A follower's wait for the verdict of a multi-rank save, its part delivered (loop thread or
upload process; the trainer's loop thread after its upload process died). The coordinator's
side is :mod:`.rank_commit`.

A follower returns when the step's manifest names its save (committed), and raises
:class:`RankFailedError` when the verdict is ``abort``. It learns that a save committed
only from positive evidence: the manifest naming it, or -- its part already removed -- the
save's ``commit`` verdict, which retention and re-saves keep for a while for exactly this
(:mod:`aiosnap.catalog.tombstones`). Its part gone without one (``aiosnap gc`` removed the
attempt) proves nothing.

Whenever a follower gives up, it first writes the ``abort`` verdict (only if absent), so
that the coordinator can no longer commit: a verdict the ranks disagree on is impossible.
It gives up when the coordinator's heartbeat has stopped for ``heartbeat_timeout``, when the
coordinator has made no progress (no chunk captured or uploaded) for ``progress_timeout``
while uploading, or has waited for parts ``commit_timeout`` plus :data:`~.rank_commit.GRACE_S`. Once the
coordinator has claimed the commit, no rank can declare the save aborted: the follower waits
for the manifest ``commit_timeout`` plus :data:`~.rank_commit.GRACE_S` from when it saw the
claim (a coordinator held up that long is the one case where the outcome is not known:
:class:`RankTimeoutError` says that the step may still be committed).
"""

from __future__ import annotations

import logging
import time

from ..catalog.steps import read_manifest
from ..config import DistributedConfig
from ..core.names import manifest_name
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, RankFailedError, RankTimeoutError
from ..format.parts import part_name
from ..format.spec import SaveSpec
from ..storage.base import Storage
from .heartbeat import PeerWatch
from .rank_commit import GRACE_S, Backoff
from .verdict import claim_verdict, given_up, read_verdict

__all__ = ["wait_for_commit"]

log = logging.getLogger("aiosnap")


async def _names_this_save(storage: Storage, spec: SaveSpec) -> bool:
    if not await storage.exists(manifest_name(spec.step)):
        return False
    try:
        return (await read_manifest(storage, spec.step)).save_id == spec.save_id
    except (CheckpointNotFoundError, CorruptCheckpointError):
        return False  # replaced or being replaced: look again


class _Waiting:
    """What one follower has seen of the coordinator so far (loop thread)."""

    def __init__(self, storage: Storage, spec: SaveSpec, config: DistributedConfig) -> None:
        assert spec.distributed is not None
        self.storage = storage
        self.spec = spec
        self.config = config
        self.coordinator = spec.distributed.coordinator
        self.bound = spec.distributed.commit_timeout + GRACE_S
        self.watch = PeerWatch(storage, spec, config)
        self.claim_seen: float | None = None
        self.gathering_since: float | None = None

    async def claimed(self) -> bool:
        """The commit is claimed: True when this rank's part is gone (the step committed,
        and was removed since); :class:`RankTimeoutError` once its manifest is overdue."""
        now = time.monotonic()
        if self.claim_seen is None:
            self.claim_seen = now
        if not await self.storage.exists(part_name(self.spec.step, self.spec.save_id, self.spec.rank)):
            return True
        if now - self.claim_seen > self.bound:
            raise RankTimeoutError(
                f"step {self.spec.step}: the coordinator (rank {self.coordinator}) claimed the commit "
                f"{now - self.claim_seen:.1f} s ago, but its manifest has not appeared (commit_timeout "
                f"{self.bound - GRACE_S:g} s plus {GRACE_S:g} s): the step may still be committed (see `aiosnap ls`); "
                "this rank's data is left in place"
            )
        return False

    async def reason_to_give_up(self) -> RankTimeoutError | None:
        """No verdict yet: why this rank must declare the save aborted (None: wait on)."""
        stopped = await self.watch.stopped([self.coordinator])
        if stopped is None:
            return None  # between two looks at its heartbeat
        step, coordinator, now = self.spec.step, self.coordinator, time.monotonic()
        if stopped:
            return RankTimeoutError(
                f"step {step}: the coordinator (rank {coordinator}) stopped: no heartbeat for "
                f"{self.watch.silence(coordinator):.1f} s (heartbeat_timeout {self.config.heartbeat_timeout:g} s); "
                "nothing was committed"
            )
        if self.watch.phase(coordinator) == "gathering":
            if self.gathering_since is None:
                self.gathering_since = now
            if now - self.gathering_since > self.bound:
                return RankTimeoutError(
                    f"step {step}: the coordinator (rank {coordinator}) waited for the ranks' parts longer than "
                    f"commit_timeout ({self.bound - GRACE_S:g} s) plus {GRACE_S:g} s; nothing was committed"
                )
        elif self.watch.idle(coordinator) > self.config.progress_timeout:
            return RankTimeoutError(
                f"step {step}: the coordinator (rank {coordinator}) made no progress (no chunk captured or uploaded) "
                f"for {self.watch.idle(coordinator):.1f} s (progress_timeout {self.config.progress_timeout:g} s), "
                "although its heartbeat went on; nothing was committed"
            )
        return None

    async def declare_aborted(self, why: RankTimeoutError) -> None:
        """Write the ``abort`` verdict and raise; returns when the commit was claimed first."""
        try:
            verdict = await claim_verdict(self.storage, self.spec, "abort", why)
        except Exception as exc:
            raise RankTimeoutError(
                f"{why}: so this rank tried to declare the save aborted, which failed ({type(exc).__name__}: "
                f"{exc}); the step may still be committed, this rank's data is left in place"
            ) from exc
        if verdict.verdict == "abort":
            raise why if verdict.rank == self.spec.rank else RankFailedError(f"{why} (declared by rank {verdict.rank})")


async def wait_for_commit(storage: Storage, spec: SaveSpec, config: DistributedConfig) -> None:
    """Non-coordinator, once its part is delivered: return when the save committed (see the
    module docstring); :class:`RankFailedError` when it was given up (by any rank: this one
    declares it when the coordinator stopped or made no progress); :class:`RankTimeoutError`
    when the coordinator claimed the commit and its manifest is overdue."""
    waiting = _Waiting(storage, spec, config)
    backoff = Backoff(None, spec.world_size)
    while True:
        if await _names_this_save(storage, spec):  # first: a manifest naming this save is the commit
            return
        verdict = await read_verdict(storage, spec)
        if verdict is not None and verdict.verdict == "abort":
            raise given_up(spec, verdict)
        if verdict is not None:
            if await waiting.claimed():
                log.info("aiosnap: step %d was committed, and removed by a later commit before rank %d saw it",
                         spec.step, spec.rank)  # fmt: skip
                return
        else:
            why = await waiting.reason_to_give_up()
            if why is not None:
                await waiting.declare_aborted(why)
                continue  # the coordinator claimed the commit meanwhile: its manifest follows
        await backoff.sleep()
