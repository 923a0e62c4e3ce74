"""One save attempt on the trainer side, from its admission to its outcome.

A :class:`SaveJob` is made by the engine once the save holds a pending-save slot; it copies
every chunk into the staging slabs (or the spool), hands each to the transfer side, waits
for the transfer side's outcome and settles the save's two futures: ``captured`` (what
``save()`` returns on) and ``durable`` (what the handle waits for). Everything here runs on
aiosnap's loop thread; the copies run on the copier's thread.

Its phase, and what moves it on::

    capturing  --every chunk staged, step order checked-->  captured
    captured   --the transfer side's upload stage ended-->  committing
    committing --outcome committed-->                       committed
    any        --outcome not committed / an error-->        failed
    any        --cancelled (save() or close())-->           cancelled
    capturing  --the caller gave save() up (abort)-->       aborted (then cancelled or failed)

A save cancelled before ``captured`` is aborted: it can no longer commit and holds no step.
Once captured it is independent of its caller: only ``close(timeout)`` cancels it, and then
it still waits for the transfer side's outcome (see :meth:`SaveJob._outcome`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..core.aio import finish_despite_cancel
from ..core.cudaorder import CudaOrder
from ..core.events import ScopeEmitter
from ..core.failures import FailureLedger
from ..core.progress import ProgressTracker
from ..errors import RankTimeoutError, UploadProcessError
from ..format.placement import Landing
from ..handoff.contract import FileChunk, SlabChunk, Staged, Transfer, TransferOutcome
from ..storage.base import Storage
from ..trainer.capture import capture_chunks
from ..trainer.chunks import SavePlan
from ..transfer.commit import Preflight
from .jobspool import JobSpool
from .resources import Resources

if TYPE_CHECKING:
    from .transferlink import TransferLink

__all__ = ["ABORT_GRACE_S", "PREFLIGHT_GRACE_S", "JobContext", "Phase", "SaveJob", "SaveResult"]

log = logging.getLogger("aiosnap")

ABORT_GRACE_S = 10.0
"""How long an aborted save waits for the transfer side's outcome once its caller stopped
waiting (``close(timeout)``): an upload process that does not answer by then (stopped,
wedged) is killed; its saves fail with UploadProcessError, except those whose step is read
back as committed."""

PREFLIGHT_GRACE_S = 1.0
"""How long save() waits, once capture is done, for the look at the root to finish; a
slower store lets save() return and the step order is checked before the commit."""

Phase = Literal["capturing", "captured", "committing", "committed", "failed", "cancelled", "aborted"]
ENDED: frozenset[Phase] = frozenset({"committed", "failed", "cancelled"})


@dataclass(frozen=True)
class SaveResult:
    """Figures of one committed save (seconds are measured from the ``save()`` call)."""

    step: int
    save_id: str
    nbytes: int
    objects: int
    blocked_s: float
    durable_s: float
    ram_high_water: int
    deleted_steps: tuple[int, ...]
    spooled_chunks: int = 0
    """Chunks that went through the local-disk spool."""
    spool_fallback: str | None = None
    """Why spooling stopped for this save (disk full, unwritable), if it did."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds each stage took: capture, spool (when used), upload, commit."""
    spool_high_water: int | None = None
    """Most bytes of spool disk ever held at once (None without a spool)."""

    @property
    def throughput(self) -> float:
        """Bytes per second from ``save()`` to durable."""
        return self.nbytes / self.durable_s if self.durable_s > 0 else 0.0


@dataclass(frozen=True)
class JobContext:
    """What every save of one engine shares: its staging resources, its link to the
    transfer side, its failure ledger and its own root's URL (the spool's owner)."""

    resources: Resources
    link: TransferLink
    failures: FailureLedger
    owner_url: str


class SaveJob:
    """One save attempt in flight (loop thread)."""

    def __init__(
        self,
        context: JobContext,
        plan: SavePlan,
        order: CudaOrder | None,
        started: float,
        storage: Storage,
        keep_last: int | None,
        emit: ScopeEmitter,
        progress: ProgressTracker,
        transfer: Transfer,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.context = context
        self.plan = plan
        self.order = order
        self.started = started
        self.storage = storage
        self.keep_last = keep_last
        self.emit = emit
        self.progress = progress
        self.transfer = transfer
        """The transfer side this save went to (an upload process that died is replaced for
        later saves; its own saves end with it)."""
        self.captured: asyncio.Future[float] = loop.create_future()
        self.durable: concurrent.futures.Future[SaveResult] = concurrent.futures.Future()
        self.durable.set_running_or_notify_cancel()  # nobody may cancel it from outside
        self.preflight: asyncio.Future[Preflight] = loop.create_future()
        self.outcome: asyncio.Future[TransferOutcome] = loop.create_future()
        self.task: asyncio.Task[None] | None = None
        self.capture: asyncio.Task[None] | None = None
        self.spooling = JobSpool(plan, context.resources)
        """Its spool session and the side writes its end waits for."""
        self.blocked = 0.0
        self.stages: dict[str, float] = {}
        self.phase: Phase = "capturing"
        self.aborted = False
        """Given up before capture ended: it can no longer commit, and holds no step."""
        self.cancelled_by_close = False
        """Cancelled while it waited for its outcome (``close(timeout)``): the TimeoutError close
        raises reports it, not the UploadProcessError of the helper killed for not answering."""

    # -- its life ----------------------------------------------------------------------------

    def never_began(self, error: BaseException) -> None:
        """The transfer side refused the save at its start (the upload process is gone):
        save() itself raises ``error``."""
        self.phase = "failed"
        self.progress.stage("failed")
        self.emit("exception", exception=error)
        self.durable.set_exception(error)
        self.durable.exception()  # raised here, by save() itself

    async def run(self) -> None:
        """The save's task: capture, then its outcome, then its end."""
        failure: BaseException | None = None
        self.capture = asyncio.ensure_future(self._capture())
        try:
            await self.capture
        except asyncio.CancelledError as exc:
            if not self.capture.done():  # the caller (or close) cancelled this save
                self.capture.cancel()
                await asyncio.wait([self.capture])
            failure = exc if not self.outcome.done() else None  # else: the transfer side failed first
        except BaseException as exc:
            failure = exc
        if failure is not None or not self.captured.done():
            self.abort_transfer()
        outcome = await self._outcome()  # (a chunk staged after it still comes back: TransferLink.lent)
        await finish_despite_cancel(self.spooling.finish())
        if outcome.committed:
            self._succeed(outcome)
        else:
            self._fail(failure if failure is not None else (outcome.error or asyncio.CancelledError()))

    def abort(self) -> None:
        """The caller gave up on ``save()`` before receiving its handle: abort this save
        unless its commit has begun (then it stands)."""
        if self.task is None:
            return
        if not self.captured.done():
            self.aborted = True  # its retry may start while the transfer side winds it down
            self.phase = "aborted"
            self.task.cancel()  # (if it never ran, only the next line tells the transfer side)
        self.abort_transfer()

    def abort_transfer(self, *, even_committing: bool = False) -> None:
        """Tell the save's transfer side to give it up; never raises (an upload process that
        is gone fails that save by itself)."""
        try:
            self.transfer.abort(self.plan.save_id, even_committing=even_committing)
        except Exception as exc:
            log.debug("aiosnap: aborting %s on the transfer side failed: %r", self.plan.save_id, exc)

    def settle(self) -> None:
        """Its task ended, however (cancelled before its first step included): settle
        whatever is not settled."""
        self.progress.stage("cancelled")  # (a save that ended otherwise stays as it ended)
        if self.phase not in ENDED:
            self.phase = "cancelled"
        if not self.captured.done():
            self.captured.cancel()
        if not self.durable.done():
            self.emit("exception", exception=asyncio.CancelledError())
            self.durable.set_exception(
                concurrent.futures.CancelledError(f"save of step {self.plan.step} was cancelled")
            )

    async def _outcome(self) -> TransferOutcome:
        """Wait for the transfer side's outcome; cancelled meanwhile (close(timeout)), ask
        it to abort and wait on: it always reports -- or, an upload process that does not
        within :data:`ABORT_GRACE_S`, is killed and its end reports for it."""
        given_up = False
        while True:
            try:
                if not given_up:
                    return await asyncio.shield(self.outcome)
                await asyncio.wait([self.outcome], timeout=ABORT_GRACE_S)
                if self.outcome.done():
                    return self.outcome.result()
                kill = getattr(self.transfer, "kill", None)  # an upload process that does not answer
                if kill is None:
                    given_up = False
                    continue
                log.warning("aiosnap: the upload process did not answer an abort in %g s; killing it", ABORT_GRACE_S)
                kill()  # its end of file fails every save it had (transfer_lost)
                return await asyncio.shield(self.outcome)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None:
                    current.uncancel()
                self.abort_transfer(even_committing=True)
                given_up = self.cancelled_by_close = True

    # -- capture -----------------------------------------------------------------------------

    async def _capture(self) -> None:
        """Copy every chunk, check the step order, and let save() return."""
        resources, transfer = self.context.resources, self.transfer
        pool = resources.pool
        assert pool is not None
        plan = self.plan
        if self.outcome.done():  # refused by the transfer side before anything was copied
            return
        session = self.spooling.open(self.storage, self.context.owner_url, self.keep_last)
        if self.context.link.securing:  # a save started after a preemption (the trainer's last one)
            self.keep_resumable()
        capture_started = time.perf_counter()
        await capture_chunks(
            plan, pool, resources.executor, resources.copier, self.order,
            stage=self._stage,
            may_upload=lambda: transfer.may_upload(plan.save_id),
            spool=session,
        )  # fmt: skip
        if session is not None:
            await session.captured()  # the journal says so before save() returns
        capture_done = time.perf_counter()
        if self.outcome.done():  # the transfer side failed meanwhile: save() reports it
            return
        await self._check_preflight()
        self.blocked = time.perf_counter() - self.started
        self.stages["capture"] = capture_done - capture_started
        self.captured.set_result(self.blocked)
        self.phase = "captured"
        self.progress.stage("uploading")
        self.emit("end", stage="capture", nbytes=plan.total_bytes, seconds=self.stages["capture"])
        if session is not None and session.spooled:
            self.stages["spool"] = session.spool_seconds
            self.emit("end", stage="spool", nbytes=session.spooled_bytes, seconds=session.spool_seconds)
        transfer.captured(plan.save_id)

    def _stage(self, chunk: Staged) -> None:
        link = self.context.link
        link.lend(self.plan.save_id, chunk, self.transfer)
        self.progress.captured(self.plan.chunks[chunk.index].payload, spooled=isinstance(chunk, FileChunk))
        self.transfer.staged(chunk)
        if link.securing and isinstance(chunk, SlabChunk):
            self.secure(chunk)

    async def _check_preflight(self) -> None:
        """Refuse the step in save() itself when the look at the root is back in time;
        otherwise (a slow store, or one that failed: a background failure like any other)
        it is checked before the commit, on the transfer side."""
        if not self.preflight.done():
            await asyncio.wait([self.preflight], timeout=PREFLIGHT_GRACE_S)
        if self.preflight.done() and self.preflight.exception() is None:
            self.preflight.result().check(self.storage.url)

    # -- the spool under preemption -------------------------------------------------------

    def keep_resumable(self) -> None:
        """Preempted: journal this save whatever it holds in RAM (see SpoolSession.keep_resumable)."""
        if not self.aborted:
            self.spooling.keep_resumable()

    def secure(self, chunk: SlabChunk) -> None:
        """Preempted: write ``chunk`` (in RAM) to the save's spool folder as well."""
        if not self.aborted:
            self.spooling.secure(chunk, self.progress.spooled)

    # -- what the transfer side told (through TransferLink) ---------------------------------

    def preflight_back(self, latest: int | None, error: BaseException | None) -> None:
        """The look at the root is back: the latest committed step there, or why not."""
        if self.preflight.done():
            return
        if error is not None:
            self.preflight.set_exception(error)
            self.preflight.exception()  # the transfer side reports it, if it matters
        else:
            self.preflight.set_result(Preflight(self.plan.step, latest))

    def chunk_done(self, index: int, pieces: Landing | None, lent: bool) -> None:
        """Chunk ``index`` landed (``pieces``) or will not be uploaded (None); ``lent``: it
        was still lent out (its slab or spool file just came back)."""
        if pieces is not None:
            self.progress.landed(index, self.plan.chunks[index].payload)
        else:
            self.progress.dropped(index)
        if lent or pieces is not None:
            self.spooling.done_with(index, pieces)

    def sent(self, index: int, nbytes: int) -> None:
        """``nbytes`` more of chunk ``index`` reached storage."""
        if 0 <= index < len(self.plan.chunks):
            self.progress.sending(index, nbytes, self.plan.chunks[index].payload)

    def stage_ended(self, stage: str, nbytes: int, seconds: float) -> None:
        """A stage of the transfer side (``upload``, ``commit``) is over."""
        self.stages[stage] = seconds
        if stage == "upload":
            self.phase = "committing"
            self.progress.stage("committing")
        self.emit("end", stage=stage, nbytes=nbytes, seconds=seconds)

    def finish(self, outcome: TransferOutcome) -> None:
        """The transfer side's outcome (the first one counts)."""
        if self.outcome.done():
            return
        self.outcome.set_result(outcome)
        if self.capture is not None and not self.capture.done():
            self.capture.cancel()  # the transfer side failed while capture went on: stop it

    # -- its end -----------------------------------------------------------------------------

    def _succeed(self, outcome: TransferOutcome) -> None:
        session, resources = self.spooling.session, self.context.resources
        result = SaveResult(
            step=self.plan.step,
            save_id=self.plan.save_id,
            nbytes=self.plan.total_bytes,
            objects=len(self.plan.chunks),
            blocked_s=self.blocked,
            durable_s=time.perf_counter() - self.started,
            ram_high_water=resources.budget.high_water,
            deleted_steps=outcome.deleted_steps,
            spooled_chunks=0 if session is None else session.spooled,
            spool_fallback=None if session is None else session.fallback,
            stage_seconds={**self.stages, **outcome.stage_seconds},
            spool_high_water=None if resources.spool is None else resources.spool.budget.high_water,
        )
        self.phase = "committed"
        self.progress.stage("committed")
        self.emit("end", nbytes=result.nbytes, seconds=result.durable_s)
        if not self.captured.done():
            self.captured.set_result(result.blocked_s)
        self.durable.set_result(result)

    def _fail(self, failure: BaseException) -> None:
        """Report ``failure`` once: by save() itself when it has not returned yet, else to
        whoever waits for the handle, else by the next save() or close()."""
        step = self.plan.step
        cancelled = isinstance(failure, asyncio.CancelledError)
        self.phase = "cancelled" if cancelled else "failed"
        self.progress.stage("cancelled" if cancelled else "failed")
        self.emit("exception", exception=failure)
        if not self.captured.done():
            if cancelled:
                self.captured.cancel()
            else:
                self.captured.set_exception(failure)
                self.captured.exception()  # seen by save(), or by nobody if save() was cancelled
        elif not cancelled and not (
            self.cancelled_by_close and isinstance(failure, (UploadProcessError, RankTimeoutError))
        ):  # (close's own TimeoutError reports a save it gave up on)
            self.context.failures.record(failure)  # before the handle can hand it out: see FailureLedger
        if cancelled:
            self.durable.set_exception(concurrent.futures.CancelledError(f"save of step {step} was cancelled"))
        else:
            self.durable.set_exception(failure)
