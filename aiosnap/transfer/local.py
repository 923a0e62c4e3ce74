"""The transfer side of saves: upload staged chunks, commit, retention, settle failures.

:class:`LocalTransfer` runs on one event loop: the trainer's loop thread (``upload.executor:
thread``) or the upload process's own (``process``, driven by :mod:`.helper`); the same
code either way. It knows a save as its :class:`~aiosnap.format.spec.SaveSpec` and the
chunks the trainer side stages (descriptors), and tells the trainer side what happened
through a :class:`~aiosnap.handoff.contract.TransferListener`: the root's latest step (preflight),
the bytes of each chunk as they reach storage, each chunk it is done with, each stage, the
outcome. The commit protocol is in
:mod:`.commit`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ..catalog.steps import apply_retention, latest_committed
from ..catalog.tombstones import Tombstones
from ..config import Config
from ..core.aio import complete_before_cancel, finish_despite_cancel
from ..core.arena import Arena
from ..core.budget import ByteBudget
from ..core.progress import counting_sent
from ..errors import CorruptCheckpointError, first_error
from ..format.dtypes import dtype_itemsize
from ..format.manifest import Checksums, Manifest, build_manifest
from ..format.placement import BaseRanges, Landing
from ..format.spec import SaveSpec
from ..handoff.contract import FileChunk, Staged, TransferListener, TransferOutcome
from ..interop.safetensors.live import LiveExport
from ..storage.base import Storage
from ..storage.registry import storage_from_url
from .commit import Preflight, checked_document, commit_manifest, preflight, remove_attempt, whose_commit
from .heartbeat import Heartbeat
from .rank_commit import Reached, check_objects, commit_claimed, deliver_part, gather_manifest
from .rank_settle import settle_rank
from .rank_wait import wait_for_commit
from .readback import CheckedRanges
from .references import IncrementalSave, check_references, take_back
from .upload import upload_chunk
from .verdict import claim_verdict, given_up

__all__ = ["CLEANUP_WAIT_S", "LocalTransfer"]

log = logging.getLogger("aiosnap")

CLEANUP_WAIT_S = 10.0
"""How long closing lets the removal of failed attempts run before leaving them to gc."""


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Done callback: mark a side task's outcome as seen (its failure is reported elsewhere)."""
    if not task.cancelled():
        task.exception()


class LocalTransfer:
    """Every save's transfer side, on the loop that calls it (all methods: that loop's
    thread). ``listener`` hears about each save; ``arena`` holds the staged slabs.

    Uploads wait until capture is over or would wait for RAM (or spool disk): on the
    trainer's own loop, sending would compete with the capture copy for the trainer's GIL;
    in the upload process, for CPU time and memory bandwidth (measured with the spool bench
    on 2 cores: save() blocked 1.4-1.5 s with uploads starting at the first chunk, 1.0-1.1 s
    without). Either way it would lengthen ``save()``, which is what training waits for."""

    def __init__(self, config: Config, arena: Arena, listener: TransferListener, scratch_bytes: int = 0) -> None:
        self.config = config
        self.arena = arena
        self.scratch = ByteBudget(scratch_bytes, "packing scratch") if scratch_bytes else None
        """The share of the RAM budget that packing incremental or compressed chunks uses
        (none: they land whole)."""
        self.listener = listener
        self._roots: dict[str, Storage] = {}
        self._broken_roots: dict[str, BaseException] = {}
        self._saves: dict[str, _Upload] = {}
        self._cleanups: set[asyncio.Task[None]] = set()
        self._abandoned = False
        self._warm_ups: set[asyncio.Task[None]] = set()
        self.tombstones = Tombstones()  # verdicts of multi-rank steps this side removed, kept a while
        self.trainer_alive: Callable[[], bool] | None = None  # upload process: heartbeats only while pinged
        self.bases: dict[str, BaseRanges] = {}
        """Per root: the ranges of the last step an incremental save committed there."""
        self.whole_next: set[str] = set()
        """Roots whose next save writes every byte (a reference of the last one was gone)."""
        self.checked = CheckedRanges()
        """Per root: the stored ranges this side wrote or read back (a save names only those)."""

    def open_root(self, url: str, storage: Storage | None = None) -> None:
        """Saves to ``url`` go through ``storage`` (made from the URL when None)."""
        if url not in self._roots:
            self._roots[url] = storage if storage is not None else storage_from_url(url, self.config)
            warm_up = asyncio.get_running_loop().create_task(self._connect(self._roots[url]))
            self._warm_ups.add(warm_up)
            warm_up.add_done_callback(self._warm_ups.discard)

    @staticmethod
    async def _connect(storage: Storage) -> None:
        try:
            await storage.connect()
        except Exception as exc:  # the first request of a save reports it
            log.debug("aiosnap: %s: connecting ahead of the first save failed: %r", storage.url, exc)

    def cannot_open(self, url: str, error: BaseException) -> None:
        """The backend for ``url`` could not be made here: saves to it fail with ``error``."""
        self._broken_roots[url] = error

    def begin(self, save_id: str, url: str, keep_last: int | None, spec: SaveSpec) -> None:
        """A save starts: look at its root (preflight) and wait for its chunks."""
        broken = self._broken_roots.get(url)
        if broken is not None:
            self.listener.finished(save_id, TransferOutcome(committed=False, error=broken))
            return
        self.open_root(url)
        try:
            self._roots[url].attempt_started(spec)
        except Exception as exc:
            self.listener.finished(save_id, TransferOutcome(committed=False, error=exc))
            return
        upload = _Upload(self, save_id, self._roots[url], keep_last, spec)
        self._saves[save_id] = upload
        upload.task = asyncio.get_running_loop().create_task(upload.run())
        upload.task.add_done_callback(upload.cancelled_before_running)

    def staged(self, chunk: Staged) -> None:
        """A captured chunk, to upload (or to hand straight back if its save is over)."""
        upload = self._saves.get(chunk.save_id)
        if upload is None or not upload.accepting:
            self.listener.done_with(chunk.save_id, chunk.index, None)
            return
        upload.put(chunk)

    def may_upload(self, save_id: str) -> None:
        """Capture would wait for RAM or spool disk: uploads may start before it is done."""
        upload = self._saves.get(save_id)
        if upload is not None:
            upload.may_start.set()

    def captured(self, save_id: str) -> None:
        """Every chunk of the save is staged."""
        upload = self._saves.get(save_id)
        if upload is not None:
            upload.all_staged()

    def abort(self, save_id: str, *, even_committing: bool = False) -> None:
        """The trainer side gave the save up (cancelled, or capture failed): stop it, unless
        its commit has begun (then it stands) -- or even then, for ``close(timeout)``: the
        interrupted commit's outcome is read back."""
        upload = self._saves.get(save_id)
        if upload is not None and upload.task is not None and (even_committing or not upload.commit_started):
            upload.task.cancel()

    def busy_steps(self, storage: Storage) -> set[int]:
        """Steps with a save in flight to the root of ``storage``."""
        return {u.spec.step for u in self._saves.values() if u.storage.url == storage.url}

    def earlier_saves(self, upload: _Upload) -> list[asyncio.Task[None]]:
        """The saves to the root of ``upload`` begun before it and still in flight."""
        earlier: list[asyncio.Task[None]] = []
        for other in self._saves.values():
            if other is upload:
                break
            if other.storage.url == upload.storage.url and other.task is not None and not other.task.done():
                earlier.append(other.task)
        return earlier

    def forget(self, upload: _Upload) -> None:
        self._saves.pop(upload.save_id, None)

    @property
    def abandoned(self) -> bool:
        """The trainer that owned these saves is gone (see :meth:`close`)."""
        return self._abandoned

    def clean_up_later(self, storage: Storage, step: int, save_id: str) -> None:
        """Remove a failed attempt's folder in the background (close waits, bounded); not
        once the trainer that owned it is gone (see :meth:`close`)."""
        if self._abandoned:
            log.info("aiosnap: step %d (save %s) left in place: its trainer is gone", step, save_id)
            return
        cleanup = asyncio.get_running_loop().create_task(remove_attempt(storage, step, save_id))
        self._cleanups.add(cleanup)
        cleanup.add_done_callback(self._cleanups.discard)

    async def close(self, *, abandoned: bool = False) -> None:
        """Cancel what still runs, give removals of failed attempts :data:`CLEANUP_WAIT_S`
        (the rest is left to ``aiosnap gc``), close the storages. ``abandoned``: the trainer
        died (the upload process outlived it); what was cancelled is left in place, since the
        next process may resume a spooled save into the same attempt folder meanwhile."""
        self._abandoned = self._abandoned or abandoned
        running = [u.task for u in self._saves.values() if u.task is not None] + list(self._warm_ups)
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
        if self._cleanups:
            _, late = await asyncio.wait(set(self._cleanups), timeout=CLEANUP_WAIT_S)
            for task in late:
                task.cancel()
            if late:
                log.warning("aiosnap: %d failed attempt(s) not removed by close(); `aiosnap gc` will", len(late))
                await asyncio.wait(late)
        for storage in self._roots.values():
            if self.tombstones:
                await self.tombstones.sweep(storage)  # the young ones are left for gc
            await storage.close()
        self._roots.clear()


class _StageClock:
    """When the upload stage ran: first chunk taken to last chunk landed."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None

    def began(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def landed(self) -> None:
        self.last = time.perf_counter()

    @property
    def seconds(self) -> float:
        return 0.0 if self.first is None or self.last is None else self.last - self.first


class _Upload:
    """One save on the transfer side."""

    def __init__(self, owner: LocalTransfer, save_id: str, storage: Storage, keep_last: int | None, spec: SaveSpec):
        self.owner = owner
        self.save_id = save_id
        self.storage = storage
        self.keep_last = keep_last
        self.spec = spec
        self.task: asyncio.Task[None] | None = None
        self.accepting = True
        self.commit_started = False
        self.may_start = asyncio.Event()
        self._queue: asyncio.Queue[Staged | None] = asyncio.Queue()
        self._outstanding: set[int] = set()
        self._workers = min(owner.config.upload.concurrency, max(1, len(spec.chunks)))
        self._stages: dict[str, float] = {}
        self._ran = False
        self.reached: Reached = "uploading"
        self.heartbeat = (
            None if spec.distributed is None
            else Heartbeat(storage, spec, owner.config.distributed, alive=owner.trainer_alive)
        )  # fmt: skip
        self.live: LiveExport | None = None
        """The save's live export (``also_as``), fed each chunk before its slab goes back."""
        self.incremental: IncrementalSave | None = None
        """Set when the upload decides where pieces go (dedup, compression)."""
        plain = spec.archive is None and spec.also is None
        dedup = owner.config.upload.dedup and plain
        self.compress = owner.config.upload.compression == "zstd" and plain and spec.distributed is None
        if dedup or self.compress:
            url = storage.url
            known, whole = owner.bases.get(url), url in owner.whole_next
            self.incremental = IncrementalSave(storage, spec, known, whole=whole, dedup=dedup, checked=owner.checked)
            owner.whole_next.discard(url)
        self._landings: dict[int, Landing] = {}

    def put(self, chunk: Staged) -> None:
        self._outstanding.add(chunk.index)
        self._queue.put_nowait(chunk)
        if self.heartbeat is not None:
            self.heartbeat.advance()  # captured

    def all_staged(self) -> None:
        for _ in range(self._workers):
            self._queue.put_nowait(None)
        self.may_start.set()

    def _done(self, index: int, pieces: Landing | None) -> None:
        if self.heartbeat is not None:
            self.heartbeat.advance()  # uploaded (or given back)
        if index in self._outstanding:
            self._outstanding.discard(index)
            self.owner.listener.done_with(self.save_id, index, pieces)

    def cancelled_before_running(self, task: asyncio.Task[None]) -> None:
        """Done callback: an upload aborted before its first step (a helper that reads begin
        and abort in one burst) never ran ``run``'s ``finally``; end it here, or the trainer
        side would wait for its outcome forever. Nothing of it was written."""
        if self._ran:
            return
        self.accepting = False
        for index in sorted(self._outstanding):
            self._done(index, None)
        self.owner.forget(self)
        self.owner.listener.finished(self.save_id, TransferOutcome(committed=False, error=asyncio.CancelledError()))

    async def run(self) -> None:
        self._ran = True
        listener = self.owner.listener
        look = asyncio.ensure_future(preflight(self.storage, self.spec.step))
        look.add_done_callback(self._tell_preflight)
        if self.heartbeat is not None:
            self.heartbeat.start()
        try:
            try:
                outcome = await self._save(look)
            except BaseException as exc:
                outcome = await finish_despite_cancel(self._settle(exc))
        finally:
            if self.heartbeat is not None:  # after the verdict (or this rank's failure) is written
                await finish_despite_cancel(self.heartbeat.stop())
            self.accepting = False
            look.cancel()
            for index in sorted(self._outstanding):
                self._done(index, None)
            if self.incremental is not None:
                self.incremental.release()
            self.owner.forget(self)
        listener.finished(self.save_id, outcome)  # always: the trainer side waits for it

    def _tell_preflight(self, look: asyncio.Future[Preflight]) -> None:
        if look.cancelled():
            return
        error = look.exception()
        self.owner.listener.preflight(self.save_id, None if error else look.result().latest, error)

    async def _save(self, look: asyncio.Future[Preflight]) -> TransferOutcome:
        """Upload, commit, retention: the happy path."""
        crcs: Checksums = {}
        clock = _StageClock()
        try:
            if self.incremental is not None and self.incremental.dedup:  # the base: before the first upload
                # not before the uploads may start (capture is over, or it waits for RAM): read
                # and parsed on this loop, the base manifest would delay the capture (~10 ms a
                # 320-entry manifest), and save() with it
                await self.may_start.wait()
                await self.incremental.start(await self._newest_committed(look))
            if self.spec.also is not None:
                self.live = LiveExport(self.storage, self.spec, memory=self.owner.config.ram_budget_bytes() // 4)
                await self.live.start()
            async with asyncio.TaskGroup() as group:
                for _ in range(self._workers):
                    group.create_task(self._worker(crcs, clock))
            if self.live is not None:
                await self.live.finish()  # the export is whole before the manifest is written
        except BaseExceptionGroup as group_error:
            await self._abort_live()
            raise (leaf := first_error(group_error)) from leaf.__cause__
        except BaseException:
            await self._abort_live()
            raise
        self._stages["upload"] = clock.seconds
        self.owner.listener.stage_ended(self.save_id, "upload", self.spec.total_bytes, clock.seconds)
        decided = await look
        decided.check(self.storage.url)
        started = time.perf_counter()
        dist = self.spec.distributed
        if dist is not None and dist.coordinator != self.spec.rank:
            self.commit_started = True  # the coordinator may commit with our part from now on
            self.reached = "delivered"
            part_bytes = await deliver_part(self.storage, self.spec, crcs, await self._checked_landings())
            assert self.heartbeat is not None
            await self.heartbeat.stop()  # the coordinator has all it needs of this rank
            await wait_for_commit(self.storage, self.spec, self.owner.config.distributed)
            self._stages["commit"] = time.perf_counter() - started
            self.owner.listener.stage_ended(self.save_id, "commit", part_bytes, self._stages["commit"])
            return TransferOutcome(committed=True, stage_seconds=dict(self._stages))
        if dist is not None:
            manifest, document = await self._gather(crcs)
        else:  # an incremental save's references checked last before the commit
            manifest, document = await self._manifest(crcs)
        self.commit_started = True
        self.reached = "committing"
        if dist is not None:  # the commit is checked to stand once its manifest landed: only then retention
            manifest_bytes = await commit_claimed(
                self.storage, self.spec, manifest, document, replace=decided.replaces, tombstones=self.owner.tombstones
            )
        else:
            manifest_bytes = await commit_manifest(self.storage, manifest, replace=decided.replaces, document=document)
            if self.incremental is not None and manifest.references:  # checked again before retention
                try:
                    await self.incremental.check(manifest)
                except CorruptCheckpointError as gone:
                    self.owner.whole_next.add(self.storage.url)
                    error, taken = await complete_before_cancel(take_back(self.storage, manifest, gone))
                    if not taken:  # the manifest stands: its data stays, for gc (never removed behind it)
                        return TransferOutcome(committed=False, error=error, stage_seconds=dict(self._stages))
                    self.commit_started = False  # taken back: the step is not committed
                    raise error from None
        if self.incremental is not None:
            self.owner.bases[self.storage.url] = BaseRanges.of(manifest, self.spec.rank)
            self.incremental.release()  # the committed manifest names what it references: retention may go
        self._stages["commit"] = time.perf_counter() - started
        self.owner.listener.stage_ended(self.save_id, "commit", manifest_bytes, self._stages["commit"])
        deleted = await self._retention()
        return TransferOutcome(committed=True, deleted_steps=tuple(deleted), stage_seconds=dict(self._stages))

    async def _manifest(self, crcs: Checksums) -> tuple[Manifest, bytes]:
        """The manifest of a one-rank save and its document, checked by the readers' own
        validator (refused before the commit starts); of an incremental one, each piece
        where it landed, its references checked to stand after the document is made, so
        that only the manifest's write follows the check (else the save fails, nothing is
        committed, and the next save to this root writes whole)."""
        if self.incremental is None:
            manifest = build_manifest(self.spec, crcs)
            return manifest, checked_document(self.storage, manifest)
        manifest = self.incremental.manifest(crcs, self._landed())
        document = checked_document(self.storage, manifest)
        await self._check(self.incremental.check(manifest))
        return manifest, document

    async def _newest_committed(self, look: asyncio.Future[Preflight]) -> int | None:
        """The step an incremental save takes its base from: the newest committed one. Saves
        to this root begun earlier (``max_pending_saves`` above 1) are waited for first, to
        commit or fail: a base older than the newest committed step is protected by nothing
        from another process's retention or gc (see :mod:`aiosnap.catalog.keep`)."""
        earlier = self.owner.earlier_saves(self)
        if not earlier:
            return (await look).latest
        await asyncio.wait(earlier)
        assert self.incremental is not None
        self.incremental.known = self.owner.bases.get(self.storage.url)  # the base they committed
        if self.storage.url in self.owner.whole_next:  # one of them found a reference gone
            self.owner.whole_next.discard(self.storage.url)
            self.incremental.whole = True
        return await latest_committed(self.storage)

    def _landed(self) -> list[Landing]:
        return [self._landings[i] for i in range(len(self.spec.chunks))]

    async def _checked_landings(self) -> list[Landing] | None:
        """A rank's part of an incremental multi-rank save: where its pieces landed, once
        the objects it references are checked to stand (each rank checks its own)."""
        if self.incremental is None:
            return None
        landings = self._landed()
        references = sorted({r for landing in landings for r in landing.references})
        await self._check(check_references(self.storage, self.spec.step, references))
        return landings

    async def _check(self, check: Coroutine[Any, Any, None]) -> None:
        """Run a reference check; when it fails, the next save to this root writes whole."""
        try:
            await check
        except CorruptCheckpointError:
            self.owner.bases.pop(self.storage.url, None)
            self.owner.whole_next.add(self.storage.url)
            raise

    async def _gather(self, crcs: Checksums) -> tuple[Manifest, bytes]:
        """Coordinator: every rank's part merged, its objects checked, the manifest
        serialized (so that after the claim only its write remains), the commit claimed."""
        assert self.heartbeat is not None
        self.reached = self.heartbeat.phase = "gathering"
        landings = await self._checked_landings()
        manifest = await gather_manifest(self.storage, self.spec, crcs, self.owner.config.distributed, landings)
        await check_objects(self.storage, manifest)
        document = checked_document(self.storage, manifest)  # a manifest no reader takes is never claimed
        self.reached = "claiming"
        verdict = await claim_verdict(self.storage, self.spec, "commit")
        if verdict.verdict == "abort":  # a follower found this rank stopped (its heartbeat late)
            raise given_up(self.spec, verdict)
        return manifest, document

    async def _worker(self, crcs: Checksums, clock: _StageClock) -> None:
        await self.may_start.wait()
        while True:
            staged = await self._queue.get()
            if staged is None:
                return
            clock.began()
            chunk = self.spec.chunks[staged.index]
            reuse = None if self.incremental is None or not self.incremental.dedup else self.incremental.reuse
            itemsizes = (
                [dtype_itemsize(self.spec.entries[p.entry].dtype) for p in chunk.pieces] if self.compress else None
            )
            with counting_sent(functools.partial(self.owner.listener.sent, self.save_id, staged.index)):
                landing = await upload_chunk(
                    self.storage, self.owner.arena, staged, chunk, reuse, itemsizes, self.owner.scratch
                )
            if self.live is not None:  # before the slab goes back
                if isinstance(staged, FileChunk):
                    await self.live.take_file(staged.index, staged.path)
                else:
                    await self.live.take(staged.index, self.owner.arena.view(staged.slab, staged.nbytes))
            for piece, crc in zip(chunk.pieces, landing.crcs, strict=True):
                crcs[(chunk.object_name, piece.dst_offset)] = crc
            self._landings[staged.index] = landing
            clock.landed()
            self._done(staged.index, landing)

    async def _abort_live(self) -> None:
        if self.live is not None:
            await asyncio.shield(self.live.abort())

    async def _retention(self) -> list[int]:
        """Retention after the commit: a step it deletes takes with it only the objects that
        no kept manifest names and no save in flight pins (:mod:`aiosnap.catalog.keep`)."""
        busy = self.owner.busy_steps(self.storage) - {self.spec.step}
        tombstones = None if self.spec.distributed is None else self.owner.tombstones
        try:
            if tombstones is not None:
                await tombstones.sweep(self.storage)
            return await apply_retention(self.storage, self.keep_last, self.spec.step, busy, tombstones)
        except Exception as exc:  # the checkpoint is committed; a failed cleanup must not undo that
            log.warning("aiosnap: retention after step %d failed: %r", self.spec.step, exc)
            return []

    async def _settle(self, exc: BaseException) -> TransferOutcome:
        """A save that raised ``exc``: committed after all, or failed (its attempt removed in
        the background, or left for gc when the commit's outcome cannot be read back)."""
        step = self.spec.step
        if self.spec.distributed is not None:
            return await self._settle_distributed(exc)
        if self.commit_started:
            # a refusal (another writer's manifest is there) is definite; anything else may
            # have been a request abandoned mid-way, which on an object store can still land
            interrupted = not isinstance(exc, FileExistsError)
            verdict = await whose_commit(self.storage, step, self.save_id, write_interrupted=interrupted)
            if verdict == "ours":
                log.info("aiosnap: step %d committed although its save reported %r", step, exc)
                return TransferOutcome(committed=True, stage_seconds=dict(self._stages))
            if verdict == "unknown":
                log.warning(
                    "aiosnap: the commit of step %d may or may not have landed (%r); its data is left "
                    "in place for `aiosnap gc`", step, exc,
                )  # fmt: skip
                return TransferOutcome(committed=False, error=exc, stage_seconds=dict(self._stages))
        self.owner.clean_up_later(self.storage, step, self.save_id)
        return TransferOutcome(committed=False, error=exc, stage_seconds=dict(self._stages))

    async def _settle_distributed(self, exc: BaseException) -> TransferOutcome:
        """A rank's part of a multi-rank save raised ``exc``: committed after all, or failed
        (this rank's own data removed only once the save can no longer be committed)."""
        remove = not self.owner.abandoned
        if await settle_rank(self.storage, self.spec, exc, self.reached, remove=remove):
            return TransferOutcome(committed=True, stage_seconds=dict(self._stages))
        return TransferOutcome(committed=False, error=exc, stage_seconds=dict(self._stages))
