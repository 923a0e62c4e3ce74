"""The trainer side's link to the transfer side: the :class:`~aiosnap.handoff.contract.
Transfer` the saves go to, the chunks lent to it, and what it tells back.

:class:`TransferLink` makes the transfer side (on this loop: ``upload.executor: thread``, or
the upload process: ``process``) and makes a new one when an upload process died. It is the
transfer side's :class:`~aiosnap.handoff.contract.TransferListener`: each report goes to
the save it is about; a chunk's slab comes back to the pool whether or not its save still
runs. When an upload process dies, its lent slabs come back, its saves fail (a save whose
upload had ended is read back first: its commit may have landed), and the other ranks of a
multi-rank save hear of it through storage. Loop thread only.
"""

from __future__ import annotations

import asyncio
import logging

from ..config import Config
from ..core.aio import run_detached
from ..format.placement import Landing
from ..handoff.contract import SlabChunk, Staged, Transfer, TransferOutcome
from ..storage.base import Storage
from ..transfer.commit import Preflight, preflight, whose_commit
from ..transfer.rank_settle import settle_without_transfer
from .resources import Resources
from .savejob import PREFLIGHT_GRACE_S, SaveJob

__all__ = ["CLOSE_LOOK_S", "TransferLink"]

log = logging.getLogger("aiosnap")

CLOSE_LOOK_S = 1.0
"""How long a multi-rank save that ``close(timeout)`` gave up on, whose upload process had to
be killed, still looks for its verdict (its part delivered) before it is left undecided."""


def _alive(transfer: Transfer) -> bool:
    """Whether ``transfer`` still serves (an upload process may have died: see
    :meth:`~aiosnap.transfer.process.ProcessTransfer.alive`; one on this loop always does)."""
    alive = getattr(transfer, "alive", None)
    return alive is None or bool(alive())


class TransferLink:
    """The transfer side of one engine and the chunks lent to it (loop thread). ``jobs``
    is the engine's table of saves in flight, by save id (shared, not copied)."""

    def __init__(self, config: Config, storage: Storage, resources: Resources, jobs: dict[str, SaveJob]) -> None:
        self.config = config
        self.storage = storage
        self.resources = resources
        self.jobs = jobs
        self.transfer: Transfer | None = None
        self.lent: dict[tuple[str, int], tuple[Staged, Transfer]] = {}
        """Every chunk with the transfer side, by (save id, index): its slab comes back with
        done_with, which may arrive after its save has ended (chunks staged after the
        transfer side gave the save up)."""
        self.securing = False
        """Preempted: chunks held in RAM are written to the spool too (see :meth:`preempted`)."""

    def ready(self) -> Transfer:
        """The transfer side (a new upload process if the last one died)."""
        if self.transfer is None or not _alive(self.transfer):
            if self.config.upload.executor == "process":
                from ..transfer.process import ProcessTransfer

                self.transfer = ProcessTransfer(self.config, self.resources.arena, self, self.resources.scratch_bytes)
            else:
                from ..transfer.local import LocalTransfer

                self.transfer = LocalTransfer(self.config, self.resources.arena, self, self.resources.scratch_bytes)
            self.transfer.open_root(self.storage.url, self.storage)
        return self.transfer

    def look_meanwhile(self, job: SaveJob) -> None:
        """The upload process has not started serving yet (a save right after the checkpointer
        opened: the process still imports): when the root needs no connection (a file system),
        the trainer looks at it itself, beside the process's own look, so that save() need not
        wait for the process to start to check the step order. The first look back is the one
        save() checks; the transfer side checks its own before the commit, as always. Costs
        the trainer one listing of the root, on a thread of its own that nothing waits for:
        the look is given up once either look is back, the save ends, or after
        :data:`PREFLIGHT_GRACE_S` (a listing stuck in the kernel, a hung NFS mount, may
        linger on its thread). Not for a multi-rank save: its trainer side beats for the rank
        until the transfer side's own look is back (``Admission._bridge``); an answer
        of the trainer's would stop that heartbeat while the process still starts, and the
        other ranks would take this one for stopped. Loop thread."""
        if (
            getattr(job.transfer, "ready", True)
            or job.plan.spec.distributed is not None
            or type(job.storage).connect is not Storage.connect
        ):
            return
        storage, step = job.storage, job.plan.step
        look = asyncio.ensure_future(
            asyncio.wait_for(run_detached(lambda: preflight(storage, step), "aiosnap-look"), PREFLIGHT_GRACE_S)
        )

        def back(done: asyncio.Future[Preflight]) -> None:
            if done.cancelled():
                return
            error = done.exception()
            if error is not None:  # the process's own look reports what matters
                log.debug("aiosnap: the trainer's look at %s failed: %r", storage.url, error)
                return
            job.preflight_back(done.result().latest, None)

        look.add_done_callback(back)
        for ending in (job.preflight, job.outcome):  # (they hold the look until it ends)
            ending.add_done_callback(lambda _: look.cancel())

    def lend(self, save_id: str, chunk: Staged, transfer: Transfer) -> None:
        """``chunk`` of save ``save_id`` goes to ``transfer``: lent until done_with gives it back."""
        self.lent[(save_id, chunk.index)] = (chunk, transfer)

    def preempted(self) -> None:
        """A preemption signal came (:mod:`aiosnap.core.preemption`). The saves in flight go
        on; with a spool, every chunk they hold in RAM, and every one staged from now on, is
        written to the spool disk as well, so that a save the grace period is too short for
        is resumed by the next process. (Multi-rank saves are not resumed from a spool:
        their ranks only try to finish.) Every such save is journalled, even one with
        nothing left in RAM (its commit under way)."""
        if self.securing:
            return
        self.securing = True
        for (save_id, _), (chunk, _) in list(self.lent.items()):
            job = self.jobs.get(save_id)
            if job is not None and isinstance(chunk, SlabChunk):
                job.secure(chunk)
        for job in list(self.jobs.values()):
            job.keep_resumable()

    async def close(self) -> None:
        """Close the transfer side (removals of failed attempts get a bounded wait)."""
        if self.transfer is not None:
            await self.transfer.close()

    # -- what the transfer side tells (TransferListener) ------------------------------------

    def preflight(self, save_id: str, latest: int | None, error: BaseException | None) -> None:
        job = self.jobs.get(save_id)
        if job is not None:
            job.preflight_back(latest, error)

    def done_with(self, save_id: str, index: int, pieces: Landing | None) -> None:
        chunk, _ = self.lent.pop((save_id, index), (None, None))
        pool = self.resources.pool
        if isinstance(chunk, SlabChunk) and pool is not None:
            pool.release(chunk.slab)
        job = self.jobs.get(save_id)
        if job is not None:
            job.chunk_done(index, pieces, lent=chunk is not None)

    def sent(self, save_id: str, index: int, nbytes: int) -> None:
        job = self.jobs.get(save_id)
        if job is not None:
            job.sent(index, nbytes)

    def stage_ended(self, save_id: str, stage: str, nbytes: int, seconds: float) -> None:
        job = self.jobs.get(save_id)
        if job is not None:
            job.stage_ended(stage, nbytes, seconds)

    def finished(self, save_id: str, outcome: TransferOutcome) -> None:
        job = self.jobs.get(save_id)
        if job is not None:
            job.finish(outcome)

    def transfer_lost(self, error: BaseException, transfer: Transfer | None = None) -> None:
        """The upload process ``transfer`` died: its slabs come back (nobody reads them any
        more), its saves fail with ``error``, their spool folders stay for a later resume. A
        save whose upload stage had ended may have committed: its step is read back first."""
        for (save_id, index), (_, owner) in list(self.lent.items()):
            if transfer is None or owner is transfer:
                self.done_with(save_id, index, None)
        for job in list(self.jobs.values()):
            if transfer is not None and job.transfer is not transfer:
                continue
            if job.spooling.session is not None:
                job.spooling.session.keep = True
            if not job.preflight.done():
                job.preflight.set_exception(error)
                job.preflight.exception()
            if job.outcome.done():
                continue
            if job.plan.spec.distributed is not None:  # the other ranks must hear of it
                job.spooling.run(self._rank_lost(job, error))
            elif "upload" in job.stages:  # its commit may have begun, or landed
                job.spooling.run(self._read_back(job, error))
            else:
                self.finished(job.plan.save_id, TransferOutcome(committed=False, error=error))

    async def _rank_lost(self, job: SaveJob, error: BaseException) -> None:
        """The upload process died with this rank's part of a multi-rank save: leave the
        marker the other ranks need, or (its part delivered) wait here for the verdict --
        briefly (:data:`CLOSE_LOOK_S`) when ``close(timeout)`` gave the save up, which then
        ends undecided."""
        wait_s = CLOSE_LOOK_S if job.cancelled_by_close else None
        try:
            await settle_without_transfer(job.storage, job.plan.spec, error, self.config.distributed, wait_s=wait_s)
            outcome = TransferOutcome(committed=True)
        except Exception as exc:
            outcome = TransferOutcome(committed=False, error=exc)
        self.finished(job.plan.save_id, outcome)

    async def _read_back(self, job: SaveJob, error: BaseException) -> None:
        """The transfer side died after a save's upload stage: did its commit land?"""
        try:
            verdict = await whose_commit(job.storage, job.plan.step, job.plan.save_id, write_interrupted=True)
        except Exception as exc:
            log.debug("aiosnap: reading back step %d failed: %r", job.plan.step, exc)
            verdict = "unknown"
        if verdict == "ours":
            log.info("aiosnap: step %d committed although its upload process died", job.plan.step)
            self.finished(job.plan.save_id, TransferOutcome(committed=True))
            return
        if verdict == "unknown":
            log.warning(
                "aiosnap: the commit of step %d may or may not have landed (%r); its data is left for `aiosnap gc`",
                job.plan.step, error,
            )  # fmt: skip
        self.finished(job.plan.save_id, TransferOutcome(committed=False, error=error))
