"""Checkpointer (async) and SyncCheckpointer: two thin shims over one engine.

Both plan a save on the caller's thread (``state_dict()`` calls, flattening, chunk layout)
and hand the rest to :class:`~aiosnap.service.Engine` on aiosnap's background loop thread.
``save()`` returns once every byte of the state is captured; the handle it returns
resolves when the checkpoint is committed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from .catalog.steps import latest_committed
from .config import Config
from .core.console import SaveLineHandler, save_line
from .core.cudaorder import CudaOrder
from .core.events import EventBus, EventHandler, JsonlHandler, LoggingHandler, ProcessGroupInfo
from .core.failures import FailureLedger
from .core.loop import LoopThread
from .core.preemption import Preemption
from .core.progress import ProgressTracker, SaveProgress
from .distributed.job import DistributedJob
from .errors import CheckpointerClosedError, ConfigError, ForkedProcessError, UnsupportedCheckpointError
from .format.manifest import Manifest
from .handoff.spooldir import Spool
from .interop.safetensors.live import SafetensorsExport, also_spec, plan_live
from .interop.singlefile import storage_for
from .lifecycle import close_when_forgotten
from .load.apply import apply_state, check_meta_targets, decode_tree, plan_read
from .load.fetch import ReadPlan, naming_targets
from .load.inplace import target_tree, written_tensors
from .load.select import check_patterns
from .runtime.attachments import Attachments
from .service import Engine, ResumeReport, SaveResult, slab_bytes_for
from .storage.base import Storage
from .trainer.chunks import SavePlan
from .trainer.layout_memo import LayoutMemo
from .trainer.plan import make_plan

LEAVE_TIMEOUT_S = 10.0
"""How long a rank whose save() failed spends telling the others through storage."""

__all__ = ["Checkpointer", "SaveHandle", "SaveResult", "SyncCheckpointer", "SyncSaveHandle"]

T = TypeVar("T")
ConfigLike = Config | str | Path | dict[str, Any] | None
log = logging.getLogger("aiosnap")


class SaveHandle:
    """A save in flight (async API): ``await handle`` returns its :class:`SaveResult` once
    committed, or raises the failure with its original type (which then counts as
    reported: neither the next ``save()`` nor ``close()`` raises it again)."""

    def __init__(
        self,
        step: int,
        durable: concurrent.futures.Future[SaveResult],
        failures: FailureLedger | None = None,
        progress: ProgressTracker | None = None,
    ) -> None:
        self.step = step
        self._durable = durable
        self._failures = failures
        self._progress = progress if progress is not None else ProgressTracker(step, 0)
        self._pid = os.getpid()

    def _check_process(self) -> None:
        """In a child made by ``os.fork()`` a save still running in the parent never
        finishes here: say so instead of waiting forever."""
        if os.getpid() != self._pid and not self._durable.done():
            raise ForkedProcessError(
                f"the save of step {self.step} runs in the process that forked this one; it cannot be waited for here"
            )

    def _observed(self) -> None:
        """The caller is about to receive the save's failure."""
        if self._failures is not None and self._durable.done() and not self._durable.cancelled():
            failure = self._durable.exception()
            if failure is not None:
                self._failures.observed(failure)

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._durable.done()

    def progress(self) -> SaveProgress:
        """How far the save has got now: bytes captured, staged in RAM, spooled, uploaded,
        of its total; its stage; the upload rate. Cheap, never blocks, any thread; a
        snapshot, so compare two of them to see it move."""
        return self._progress.snapshot()

    @property
    def future(self) -> concurrent.futures.Future[SaveResult]:
        """The save's outcome as a thread-safe future (``concurrent.futures.wait`` on many)."""
        return self._durable

    @property
    def result(self) -> SaveResult | None:
        """The figures of the committed save; None while in flight or after a failure."""
        if self._durable.done() and self._durable.exception() is None:
            return self._durable.result()
        return None

    async def wait(self, timeout: float | None = None) -> SaveResult:
        """Wait until committed; TimeoutError after ``timeout`` s (the save goes on)."""
        self._check_process()
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._durable)), timeout)
        except BaseException:
            self._observed()
            raise

    def __await__(self) -> Any:
        return self.wait().__await__()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} step={self.step} done={self.done()}>"


class SyncSaveHandle(SaveHandle):
    """A save in flight (sync API): ``handle.wait()`` blocks until committed."""

    def wait(self, timeout: float | None = None) -> SaveResult:  # type: ignore[override]
        """Block until committed; TimeoutError after ``timeout`` s (the save goes on)."""
        self._check_process()
        try:
            return self._durable.result(timeout)
        except BaseException:
            self._observed()
            raise

    def __await__(self) -> Any:
        raise TypeError("SyncSaveHandle is not awaitable; call handle.wait()")


class _LoadScope:
    """What one load's events share: the bus, where, the step once known, the clock."""

    def __init__(self, events: EventBus, url: str, step: int | None) -> None:
        self.emit = events.emit
        self.url = url
        self.step = step
        self.nbytes: int | None = None
        self._started = time.perf_counter()
        self.emit("start", "load", step, url=url)

    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    def fetched(self, manifest: Manifest, tensors: dict[int, Any]) -> None:
        """The entries ``tensors`` of ``manifest`` (all of them, or a partial load's) are read
        and verified."""
        self.step = manifest.step
        self.nbytes = sum(manifest.entries[index].nbytes for index in tensors)
        self.emit("end", "load", self.step, stage="fetch", url=self.url, nbytes=self.nbytes, seconds=self.elapsed())


class _ReadChoice:
    """A load's plan maker (called once, on the loop thread, with the manifest), which keeps
    the plan's in-place entries for the caller's thread to name if restoring fails."""

    def __init__(self, make: Callable[[Manifest], ReadPlan]) -> None:
        self._make = make
        self.in_place: tuple[int, ...] = ()

    def __call__(self, manifest: Manifest) -> ReadPlan:
        plan = self._make(manifest)
        self.in_place = tuple(plan.written)
        return plan


def _handlers_for(config: Config, extra: Sequence[EventHandler]) -> list[EventHandler]:
    for handler in extra:
        if not callable(handler):
            raise TypeError(f"event_handlers: {handler!r} is not callable")
    handlers: list[EventHandler] = []
    if config.events.log:  # (what the line per save says is not said twice: see LoggingHandler)
        handlers.append(LoggingHandler(said_on_stderr=save_line if config.events.stderr else None))
    if config.events.stderr:
        handlers.append(SaveLineHandler())
    if config.events.jsonl is not None:
        try:
            handlers.append(JsonlHandler(config.events.jsonl))
        except OSError as exc:
            raise ConfigError(f"events.jsonl: cannot open {config.events.jsonl}: {exc.strerror or exc}") from exc
    return handlers + list(extra)


def _check_multi_rank_storage(storage: Storage) -> None:
    """:class:`ConfigError` unless ``storage`` can carry multi-rank saves: their verdict is
    written only if absent, and exactly one writer must win (a coordinator's commit claim
    or another rank's abort), else a rank's data could be removed under a commit."""
    if storage.read_only:  # nothing is ever written there: no verdict to split
        return
    if not storage.conditional_writes and not storage.single_file:  # (one file holds one rank: refused at save)
        hint = (
            "set s3.conditional_commit: true (the store must support If-None-Match)"
            if storage.url.startswith("s3://")
            else f"{type(storage).__name__} must set conditional_writes = True (write(if_absent=True): one writer wins)"
        )
        raise ConfigError(
            f"{storage.url}: a multi-rank checkpointer needs a store with conditional writes, so that one verdict per "
            f"save holds for every rank; {hint}"
        )


class _Core:
    """What both APIs share: config, the loop thread, the engine, the lifecycle.

    ``rank``/``world_size`` default to this process's place in ``process_group`` (the
    default group when none is given and torch.distributed is initialised; else 0 and 1).
    With more than one rank, making the checkpointer is collective: every rank of the group
    makes one, and aiosnap makes its own gloo group over those ranks, on which ``save()`` and
    ``load()`` agree (events name that group). ``event_handlers`` are callables receiving
    every :class:`~aiosnap.core.events.Event`, after the ones ``config.events`` sets up.
    """

    def __init__(
        self,
        config: ConfigLike = None,
        *,
        storage: Storage | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        process_group: Any | None = None,
        event_handlers: Sequence[EventHandler] = (),
    ) -> None:
        self.config = Config.coerce(config)
        info = ProcessGroupInfo.of(process_group, rank, world_size)
        if storage is None:
            storage = storage_for(self.config.storage.url, self.config)
        if info.world_size > 1:
            _check_multi_rank_storage(storage)
        self._job = DistributedJob(self.config.distributed, info, process_group)
        group = self._job.info
        ram_budget = self.config.ram_budget_bytes()
        self.rank = group.rank
        self.world_size = group.world_size
        self._storage = storage
        self._keep_last = self.config.retention.keep_last
        self._layouts = LayoutMemo()  # the last save's layout, while the state keeps its structure
        self._views: list[_Core] = []
        self._owner: _Core | None = None
        self._closed = False
        self.resume_report = ResumeReport()
        """What resuming the spool at start did (``spool.resume``): steps committed, saves discarded."""
        self._loaded_step: int | None = None
        events = EventBus(_handlers_for(self.config, event_handlers), group, storage.url)
        with ExitStack() as undo:  # a failure below releases what was acquired so far
            undo.callback(self._job.close)
            undo.callback(events.close)
            self._job.check_spools(self.config.spool)
            spool = Spool.open(
                self.config.spool, min_bytes=slab_bytes_for(self.config, ram_budget), digests=self.config.upload.dedup
            )
            if spool is not None:
                undo.callback(spool.close)  # the lock, so a later checkpointer may take the spool
            self._loop = LoopThread(self.config.loop)
            undo.callback(self._loop.stop)
            self._engine = Engine(self.config, storage, ram_budget, events, spool)
            undo.callback(lambda: self._loop.run(self._engine.shutdown()))
            self._loop.run(self._engine.start())
            self._attachments = Attachments(self.config, self._engine, self._loop)
            undo.callback(self._attachments.close)
            if spool is not None and self.config.spool.resume:
                self.resume_report = self._loop.run(self._engine.resume())
            undo.pop_all()
        # Forgotten (collected, or still open at interpreter exit): finish what it accepted.
        self._finalizer = close_when_forgotten(self, self._loop, self._engine, storage.url)

    def _closed_at_exit_by_its_owner(self) -> None:
        """For integrations (Lightning) whose framework may never call their closing hook:
        left open at exit, this checkpointer is closed then (its saves finished) without a
        ``ResourceWarning`` blaming the user. Caller's thread."""
        if self._owner is None and not self._closed:
            self._finalizer.detach()
            self._finalizer = close_when_forgotten(self, self._loop, self._engine, self._storage.url, warn=False)

    def _view(self, url: str, keep_last: int | None, storage: Storage | None) -> Any:
        """A checkpointer of the same class for another storage root, sharing this one's
        loop thread, RAM budget, staging slabs and event handlers."""
        self._check_open()
        if self._owner is not None:
            return self._owner._view(url, keep_last, storage)
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view._storage = storage if storage is not None else storage_for(url, self.config)
        if self.world_size > 1:
            _check_multi_rank_storage(view._storage)
        view._keep_last = keep_last
        view._views = []
        view._layouts = LayoutMemo()
        view._owner = self
        view._closed = False
        view.resume_report = ResumeReport()
        view._loaded_step = None
        self._views = [v for v in self._views if not v._closed] + [view]
        return view

    @property
    def url(self) -> str:
        """Where checkpoints go (the storage root)."""
        return self._storage.url

    @property
    def event_handlers(self) -> list[EventHandler]:
        """The handlers events go to (config's first, then the ones passed in); appendable."""
        return self._engine.events.handlers

    def flush_events(self, timeout: float | None = None) -> bool:
        """Block until every event emitted so far has reached the handlers (they run on
        their own thread; ``close()`` flushes too), at most ``timeout`` seconds; returns
        whether they all did."""
        self._check_open()
        return self._engine.events.flush(timeout)

    @property
    def loaded_step(self) -> int | None:
        """The step the latest successful ``load()`` or ``load_latest()`` of this checkpointer
        restored (the step training resumed from); None before any."""
        return self._loaded_step

    def _looks_up_latest(self) -> bool:
        """Whether this rank looks up the latest step for :meth:`_agreed_latest` (one rank
        alone; rank 0 of several)."""
        return self._job.group is None or self._job.needs_latest(None)

    def _agreed_latest(self, latest: int | None, failure: BaseException | None) -> int | None:
        """The latest committed step for every rank: this rank's own lookup alone, else rank
        0's (collective: every rank calls it; a ``failure`` of rank 0's lookup is raised
        there and a :class:`RankFailedError` on the others, at once). Caller's thread."""
        if self._job.group is None:
            if failure is not None:
                raise failure
            return latest
        return self._job.load_step(None, latest, failure)

    @property
    def loop_kind(self) -> str:
        """``uvloop`` or ``asyncio``: the background loop actually running."""
        return self._loop.kind

    @property
    def preempted(self) -> bool:
        """True once a preemption signal has arrived (``preemption.enabled``): take a last
        save and stop; the process then exits as the signal would have (see
        :mod:`aiosnap.core.preemption`). Always False when preemption is not enabled."""
        return self._attachments.preempted

    @property
    def preemption(self) -> Preemption | None:
        """The process's preemption handling (its ``event``, ``signal``,
        ``seconds_left()``), or None when ``preemption.enabled`` is off."""
        return self._attachments.preemption

    @property
    def ram_high_water(self) -> int:
        """Most bytes of staging RAM ever held at once (never above the RAM budget)."""
        return self._engine.budget.high_water

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointerClosedError(f"{type(self).__name__} for {self.url} is closed")
        if self._loop.forked():
            self._loop.submit(asyncio.sleep(0))  # raises ForkedProcessError

    def _plan(
        self,
        state: dict[str, Any],
        step: int,
        metadata: dict[str, Any] | None,
        rank_local: Sequence[str] | None = None,
        also_as: str | SafetensorsExport | None = None,
    ) -> tuple[SavePlan, CudaOrder | None]:
        """Runs on the caller's thread: take state dicts, flatten, (with several ranks)
        agree with the other ranks, lay out chunks. A rank that fails before the ranks agree
        still takes part in the agreement, as a rank that cannot save: the others raise at
        once (:class:`~aiosnap.errors.RankFailedError`) instead of waiting for it."""
        agree = self._job.agreement(step)
        try:
            self._check_open()
            if self._storage.read_only:  # a DCP folder, a safetensors folder: read, never written
                raise UnsupportedCheckpointError(
                    f"{self.url} is read-only here (a checkpoint of another format): save to an aiosnap root, or "
                    "convert it with aiosnap.export / `aiosnap export`"
                )
            if agree is not None:  # an earlier save's failure, raised here rather than after agreeing
                failure = self._engine.failures.take()
                if failure is not None:
                    raise failure
            plan = make_plan(
                state,
                step=step,
                chunk_bytes=self._engine.slab_bytes,
                rank=self.rank,
                world_size=self.world_size,
                metadata=metadata,
                single_file=self._storage.single_file,
                rank_local=self._job.rank_local(rank_local),
                agree=agree,
                memo=self._layouts,
                pickle_values=self.config.pickle_values,
            )
            if also_as is not None:  # a live export (interop.safetensors.live), checked here
                plan.spec = dataclasses.replace(plan.spec, also=also_spec(also_as))
                plan_live(plan.spec)
        except BaseException:
            if agree is not None:
                agree.abandon()
            raise
        return plan, CudaOrder.record(e.tensor for e in plan.entries)

    def _wanted(
        self, state: dict[str, Any] | None, paths: Sequence[str] | None, allow_pickle: bool, atomic: bool
    ) -> _ReadChoice:
        """What a load reads and where (caller's thread: checks the arguments, takes the
        state dicts of Stateful targets, notes where the caller's CUDA work stands; the loop
        thread plans with the manifest)."""
        if paths is not None:
            if state is not None:
                raise TypeError("load() takes a state to restore into or paths to select, not both")
            if isinstance(paths, str):
                raise TypeError(f"paths must be a list of patterns, got the string {paths!r}")
        chosen = None if paths is None else check_patterns(paths)
        found = None if state is None else target_tree(state)
        if found is not None:
            check_meta_targets(found)
        targets = None if atomic else found
        caller = None if targets is None else CudaOrder.record(written_tensors(targets))
        slab_bytes = self._engine.slab_bytes
        return _ReadChoice(
            lambda manifest: plan_read(manifest, state, targets, chosen, allow_pickle, slab_bytes, caller)
        )

    @staticmethod
    def _finish_load(
        manifest: Manifest,
        tensors: dict[int, Any],
        state: dict[str, Any] | None,
        allow_pickle: bool,
        paths: Sequence[str] | None = None,
        in_place: Sequence[int] = (),
    ) -> Any:
        """Runs on the caller's thread (load_state_dict calls). ``in_place``: the entries
        read straight into ``state``'s tensors (an error here names them)."""
        if state is None:
            chosen = None if paths is None else list(paths)
            return decode_tree(manifest, tensors, allow_pickle=allow_pickle, paths=chosen)
        try:
            apply_state(manifest, tensors, state, allow_pickle=allow_pickle)
        except Exception as exc:  # a load_state_dict refusing, after bytes landed in place
            if not in_place:
                raise
            named = naming_targets(exc, [manifest.entries[i].path for i in in_place])
            if named is exc:  # the same exception, with a note
                raise
            raise named from exc
        return state

    @contextmanager
    def _load_events(self, step: int | None) -> Iterator[_LoadScope]:
        """The event scope of one load: ``start`` now, ``end`` or ``exception`` when the body
        leaves; the body reports the fetch through :meth:`_LoadScope.fetched`. Caller's thread."""
        scope = _LoadScope(self._engine.events, self.url, step)
        try:
            yield scope
        except BaseException as exc:
            scope.emit("exception", "load", scope.step, url=self.url, exception=exc)
            raise
        scope.emit("end", "load", scope.step, url=self.url, nbytes=scope.nbytes, seconds=scope.elapsed())

    def _begin_close(self) -> bool:
        """Mark closed; False when there is nothing (more) to close: already closed, or a
        forked child, where the background thread does not exist."""
        if self._closed:
            return False
        self._closed = True
        if self._owner is None:
            self._finalizer.detach()
        return not self._loop.forked()

    def _close_views(self) -> list[Any]:
        """Storages of the views still open, marked closed (the owner closes them)."""
        storages = [view._storage for view in self._views if not view._closed]
        for view in self._views:
            view._closed = True
        return storages

    def _end_close(self, raise_failure: bool) -> None:
        if self._owner is not None:  # a view: the owner's loop and engine stay
            return
        self._attachments.close()
        self._loop.stop()
        self._engine.events.close()
        self._job.close()
        failures = self._engine.failures.take_all()
        for failure in failures[1:] if raise_failure else failures:
            log.warning("aiosnap: a save failed and nobody waited for it: %r", failure)
        if failures and raise_failure:
            raise failures[0]

    def _abort_on_interrupt(self, save_id: str) -> None:
        """The caller left save() early (cancelled, KeyboardInterrupt) after the loop may
        already have handed back the handle: abort that save unless its commit began."""
        self._loop.loop.call_soon_threadsafe(self._engine.abort, save_id)

    def _leave_distributed_save(self, plan: SavePlan, error: BaseException) -> None:
        """save() failed on this rank after the ranks agreed: unless the transfer side owns
        the save (see :meth:`Engine.leave`), tell the others through storage. Best effort,
        bounded."""
        if plan.spec.distributed is None or self._loop.forked():
            return
        future = self._loop.submit(self._engine.leave(plan, self._storage, error))
        try:
            future.result(timeout=LEAVE_TIMEOUT_S)
        except Exception as exc:  # the caller's own error is what matters
            future.cancel()
            log.warning("aiosnap: could not tell the other ranks that step %d failed here: %r", plan.step, exc)


class Checkpointer(_Core):
    """Async checkpoint service. Use ``async with Checkpointer(cfg) as ckpt:``.

    ``config`` is a :class:`Config`, a dict of its fields, or a storage URL / path.
    ``storage`` replaces the backend chosen from ``config.storage.url`` (custom backends).
    """

    async def _call(self, coro: Any) -> Any:
        return await asyncio.wrap_future(self._loop.submit(coro))

    def at(self, url: str, *, keep_last: int | None = None, storage: Storage | None = None) -> Checkpointer:
        """A checkpointer for another storage root (``keep_last`` is its retention; None
        keeps every step) that shares this one's background thread, RAM budget, staging
        slabs and event handlers. ``storage`` replaces the backend chosen from ``url``.
        Close it to wait for its saves; closing this one closes it."""
        view: Checkpointer = self._view(url, keep_last, storage)
        return view

    async def save(
        self,
        state: dict[str, Any],
        *,
        step: int,
        metadata: dict[str, Any] | None = None,
        rank_local: Sequence[str] | None = None,
        also_as: str | SafetensorsExport | None = None,
    ) -> SaveHandle:
        """Capture ``state`` and return once every byte is captured (the state may then be
        mutated). ``await`` the handle for durability. Waits first while
        ``max_pending_saves`` saves are in flight. Raises a background failure of an earlier
        save (original type) instead of starting a new one, once.

        With several ranks every rank calls it for the same step: replicated values are
        written once, DTensors as their shards, and ``rank_local`` path patterns (added to
        ``distributed.rank_local``) name values each rank saves for itself. The handle
        resolves when the step is committed (every rank's data landed) on every rank.

        ``also_as="safetensors"`` (or a :class:`~aiosnap.interop.safetensors.live.SafetensorsExport`
        naming the paths) also writes the Hugging Face layout of the state's tensors, from
        the same capture, into ``<step>/<save id>/safetensors/``, committed with the step."""
        started = time.perf_counter()
        plan, order = self._plan(state, step, metadata, rank_local, also_as)
        progress = ProgressTracker(step, plan.total_bytes, started)
        try:
            durable = await self._call(
                self._engine.save(plan, order, started, self._storage, self._keep_last, progress)
            )
        except asyncio.CancelledError as exc:
            self._abort_on_interrupt(plan.save_id)
            await asyncio.to_thread(self._leave_distributed_save, plan, exc)
            raise
        except BaseException as exc:
            await asyncio.to_thread(self._leave_distributed_save, plan, exc)
            raise
        return SaveHandle(step, durable, self._engine.failures, progress)

    async def load(
        self,
        state: dict[str, Any] | None = None,
        *,
        step: int | None = None,
        allow_pickle: bool = False,
        paths: Sequence[str] | None = None,
        atomic: bool = False,
        skip_rank_local: bool = False,
    ) -> Any:
        """Restore the latest committed step (or ``step``): into ``state`` when given (and
        return it), else as a new nested state. Only the bytes needed are read: those of the
        keys ``state`` has, or, without ``state``, those under the key paths ``paths``
        selects (glob patterns over dict keys joined by ``/``, such as ``"model/*"``; the
        result keeps the dicts above them).

        Into ``state``, bytes go straight into its contiguous CPU tensors of the saved dtype
        and shape (a module's or optimizer's own, through its ``state_dict()``): no second
        copy of the state. Every range's crc32c is checked; if one fails, the error names
        the tensors that may hold partly loaded data. ``atomic=True`` reads into new tensors
        and touches ``state`` only once everything is verified (twice the memory).

        A multi-rank checkpoint loads into any number of ranks (every rank calls ``load()``
        with the same arguments): DTensors in ``state`` get the bytes of their own shard,
        read from whichever saved shards overlap it; a load without ``state`` returns full
        tensors. Rank-local values go back to the rank that saved them; with another world
        size that is an error unless ``skip_rank_local`` (they are then left as they are)."""
        loaded, _ = await self._restore(state, step, allow_pickle, paths, atomic, skip_rank_local)
        return loaded

    async def _restore(
        self,
        state: dict[str, Any] | None,
        step: int | None,
        allow_pickle: bool,
        paths: Sequence[str] | None,
        atomic: bool,
        skip_rank_local: bool,
    ) -> tuple[Any, int]:
        """:meth:`load`, returning the step restored too."""
        self._check_open()
        wanted = self._wanted(state, paths, allow_pickle, atomic)
        with self._load_events(step) as scope:
            for attempt in self._job.load_attempts(skip_rank_local):
                latest, failure = None, None
                if self._job.needs_latest(step):
                    try:
                        found: list[int] = await self._call(self._engine.steps(self._storage))
                        latest = found[-1] if found else None
                    except BaseException as exc:  # cancelled too: the other ranks must hear of it (load_step)
                        failure = exc
                scope.step = chosen = self._job.load_step(step, latest, failure)
                read = self._engine.read(chosen, allow_pickle, self._storage, wanted, attempt.view)
                try:
                    manifest, tensors = await self._call(read)
                except BaseException as exc:  # cancelled too: the other ranks hear of it
                    if attempt.again(chosen, exc) and isinstance(exc, Exception):
                        continue
                    raise
                if attempt.again(chosen, None):
                    continue
                scope.fetched(manifest, tensors)
                loaded = self._finish_load(manifest, tensors, state, allow_pickle, paths, wanted.in_place)
                self._loaded_step = manifest.step
                return loaded, manifest.step
        raise AssertionError("unreachable: the last attempt never reads again")

    async def load_latest(
        self,
        state: dict[str, Any],
        *,
        allow_pickle: bool = False,
        atomic: bool = False,
        skip_rank_local: bool = False,
    ) -> int | None:
        """Resume: load the latest committed step into ``state`` if the root holds one and
        return that step; return None, leaving ``state`` as it is, when it holds none (the
        first run). A training loop then goes on with the step after it::

            done = await ckpt.load_latest(state)     # None on the first run
            start = 1 if done is None else done + 1  # save(step=n) after n steps

        With several ranks every rank calls it and all get the same step (rank 0's view of
        the latest). Loading works as :meth:`load` with ``state`` (the keyword arguments
        are its own); a latest step that cannot be loaded raises, it never falls back to an
        older one. :attr:`loaded_step` keeps the step afterwards."""
        self._check_open()
        latest, failure = None, None
        if self._looks_up_latest():
            try:
                latest = await self._call(latest_committed(self._storage))
            except BaseException as exc:  # cancelled too: the other ranks must hear of it (_agreed_latest)
                failure = exc
        step = self._agreed_latest(latest, failure)
        if step is None:
            return None
        single = self._job.group is None  # one rank reads "the latest" itself (one removed meanwhile: the next)
        _, restored = await self._restore(state, None if single else step, allow_pickle, None, atomic, skip_rank_local)
        return restored  # this call's own step (loaded_step may be another thread's by now)

    async def steps(self) -> list[int]:
        """Committed steps, ascending."""
        self._check_open()
        result: list[int] = await self._call(self._engine.steps(self._storage))
        return result

    async def manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (latest when None): metadata, entries, sizes."""
        self._check_open()
        result: Manifest = await self._call(self._engine.manifest(step, self._storage))
        return result

    async def resume_spool(self, progress: Callable[[int, int], None] | None = None) -> ResumeReport:
        """Finish and commit the saves a crashed process left in the spool for this root
        now (what ``spool.resume`` does at start for the configured root; for a root of
        ``at()``, call this on that view), with this root's retention.
        ``progress(nbytes, total)`` hears each spooled chunk land, from aiosnap's loop thread."""
        self._check_open()
        result: ResumeReport = await self._call(self._engine.resume(progress, self._storage, self._keep_last))
        return result

    async def purge(self) -> list[int]:
        """Wait for this root's saves, then delete every checkpoint and leftover under it
        (committed steps manifest first). Returns the steps deleted."""
        self._check_open()
        result: list[int] = await self._call(self._engine.purge(self._storage))
        return result

    async def rollback(self, step: int) -> list[int]:
        """Make committed ``step`` the latest again, to continue training from it: wait for
        this root's saves, then remove every committed step after it (newest first,
        manifest first). Returns the steps removed."""
        self._check_open()
        result: list[int] = await self._call(self._engine.rollback(self._storage, step))
        return result

    async def close(self, timeout: float | None = None, *, _raise_failure: bool = True) -> None:
        """Wait for pending saves (cancelling them after ``timeout`` s), free resources.
        Raises the last save's failure with its original type unless a later save committed."""
        if not self._begin_close():
            return
        if self._owner is not None:
            try:
                await self._call(self._engine.drain(timeout, self._storage))
            finally:
                await self._call(self._storage.close())
            return
        try:
            await self._call(self._engine.drain(timeout))
        finally:
            for storage in self._close_views():
                await self._call(storage.close())
            await self._call(self._engine.shutdown())
            self._end_close(_raise_failure)

    async def __aenter__(self) -> Checkpointer:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close(_raise_failure=exc is None)


class SyncCheckpointer(_Core):
    """The same service for plain (non-async) training loops: ``with SyncCheckpointer(cfg):``.

    Safe to call from several threads. Calling it from aiosnap's own loop thread raises
    :class:`~aiosnap.errors.WrongThreadError` at once instead of deadlocking.
    """

    def at(self, url: str, *, keep_last: int | None = None, storage: Storage | None = None) -> SyncCheckpointer:
        """See :meth:`Checkpointer.at`."""
        view: SyncCheckpointer = self._view(url, keep_last, storage)
        return view

    def save(
        self,
        state: dict[str, Any],
        *,
        step: int,
        metadata: dict[str, Any] | None = None,
        rank_local: Sequence[str] | None = None,
        also_as: str | SafetensorsExport | None = None,
    ) -> SyncSaveHandle:
        """Block until every byte of ``state`` is captured; ``handle.wait()`` for durability.
        Same waiting, failure, multi-rank and ``also_as`` rules as :meth:`Checkpointer.save`."""
        started = time.perf_counter()
        plan, order = self._plan(state, step, metadata, rank_local, also_as)
        progress = ProgressTracker(step, plan.total_bytes, started)
        try:
            durable = self._loop.run(self._engine.save(plan, order, started, self._storage, self._keep_last, progress))
        except BaseException as exc:
            self._abort_on_interrupt(plan.save_id)
            self._leave_distributed_save(plan, exc)
            raise
        return SyncSaveHandle(step, durable, self._engine.failures, progress)

    def load(
        self,
        state: dict[str, Any] | None = None,
        *,
        step: int | None = None,
        allow_pickle: bool = False,
        paths: Sequence[str] | None = None,
        atomic: bool = False,
        skip_rank_local: bool = False,
    ) -> Any:
        """See :meth:`Checkpointer.load`."""
        loaded, _ = self._restore(state, step, allow_pickle, paths, atomic, skip_rank_local)
        return loaded

    def _restore(
        self,
        state: dict[str, Any] | None,
        step: int | None,
        allow_pickle: bool,
        paths: Sequence[str] | None,
        atomic: bool,
        skip_rank_local: bool,
    ) -> tuple[Any, int]:
        """:meth:`load`, returning the step restored too."""
        self._check_open()
        wanted = self._wanted(state, paths, allow_pickle, atomic)
        with self._load_events(step) as scope:
            for attempt in self._job.load_attempts(skip_rank_local):
                latest, failure = None, None
                if self._job.needs_latest(step):
                    try:
                        found = self._loop.run(self._engine.steps(self._storage))
                        latest = found[-1] if found else None
                    except BaseException as exc:  # cancelled too: the other ranks must hear of it (load_step)
                        failure = exc
                scope.step = chosen = self._job.load_step(step, latest, failure)
                try:
                    manifest, tensors = self._loop.run(
                        self._engine.read(chosen, allow_pickle, self._storage, wanted, attempt.view)
                    )
                except BaseException as exc:  # cancelled too: the other ranks hear of it
                    if attempt.again(chosen, exc) and isinstance(exc, Exception):
                        continue
                    raise
                if attempt.again(chosen, None):
                    continue
                scope.fetched(manifest, tensors)
                loaded = self._finish_load(manifest, tensors, state, allow_pickle, paths, wanted.in_place)
                self._loaded_step = manifest.step
                return loaded, manifest.step
        raise AssertionError("unreachable: the last attempt never reads again")

    def load_latest(
        self,
        state: dict[str, Any],
        *,
        allow_pickle: bool = False,
        atomic: bool = False,
        skip_rank_local: bool = False,
    ) -> int | None:
        """Resume: load the latest committed step into ``state`` if there is one and return
        that step, else None (``state`` untouched). See :meth:`Checkpointer.load_latest`::

            done = ckpt.load_latest(state)           # None on the first run
            start = 1 if done is None else done + 1  # save(step=n) after n steps
        """
        self._check_open()
        latest, failure = None, None
        if self._looks_up_latest():
            try:
                latest = self._loop.run(latest_committed(self._storage))
            except BaseException as exc:  # cancelled too: the other ranks must hear of it (_agreed_latest)
                failure = exc
        step = self._agreed_latest(latest, failure)
        if step is None:
            return None
        single = self._job.group is None
        _, restored = self._restore(state, None if single else step, allow_pickle, None, atomic, skip_rank_local)
        return restored

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        self._check_open()
        return self._loop.run(self._engine.steps(self._storage))

    def manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (latest when None)."""
        self._check_open()
        return self._loop.run(self._engine.manifest(step, self._storage))

    def resume_spool(self, progress: Callable[[int, int], None] | None = None) -> ResumeReport:
        """See :meth:`Checkpointer.resume_spool`."""
        self._check_open()
        return self._loop.run(self._engine.resume(progress, self._storage, self._keep_last))

    def purge(self) -> list[int]:
        """See :meth:`Checkpointer.purge`."""
        self._check_open()
        return self._loop.run(self._engine.purge(self._storage))

    def rollback(self, step: int) -> list[int]:
        """See :meth:`Checkpointer.rollback`."""
        self._check_open()
        return self._loop.run(self._engine.rollback(self._storage, step))

    def close(self, timeout: float | None = None, *, _raise_failure: bool = True) -> None:
        """See :meth:`Checkpointer.close`."""
        if not self._begin_close():
            return
        if self._owner is not None:
            try:
                self._loop.run(self._engine.drain(timeout, self._storage))
            finally:
                self._loop.run(self._storage.close())
            return
        try:
            self._loop.run(self._engine.drain(timeout))
        finally:
            for storage in self._close_views():
                self._loop.run(storage.close())
            self._loop.run(self._engine.shutdown())
            self._end_close(_raise_failure)

    def __enter__(self) -> SyncCheckpointer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(_raise_failure=exc is None)
