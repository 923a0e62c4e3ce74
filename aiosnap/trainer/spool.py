"""One save's use of the local-disk spool (trainer side): spilling chunks during capture,
the append-only journal, and the files' lifetime.

Chunks that the RAM budget cannot hold (or every chunk, in ``always`` mode) are copied into
a slab, written to the spool disk, and staged to the transfer side as file paths
(:class:`~aiosnap.handoff.contract.FileChunk`). The journal (:mod:`aiosnap.format.journal`) is
started by the first spill; a spool file is deleted only after a journal record saying its
chunk landed is on disk. Loop thread; file I/O runs on worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from ..core import durable
from ..core.aio import complete_before_cancel
from ..core.tensorio import bytes_view
from ..format.journal import JOURNAL, JournalWriter, begin_record
from ..format.placement import Landing
from ..handoff.contract import FileChunk
from ..handoff.spooldir import Spool
from .chunks import Chunk, SavePlan
from .slabs import SlabPool

__all__ = ["Bounce", "SpoolSession"]

log = logging.getLogger("aiosnap")


class Bounce:
    """The one staging slab kept aside (inside the RAM budget) to spill chunks through when
    every other slab is lent out (``overflow`` mode). Loop thread."""

    def __init__(self, pool: SlabPool) -> None:
        slab = pool.try_acquire()
        if slab is None:
            raise AssertionError("a fresh pool always has a slab")
        self.slab = slab
        self.buffer = pool.tensor(slab)
        self.lock = asyncio.Lock()


class SpoolSession:
    """One save's use of the spool. Loop thread."""

    def __init__(
        self,
        spool: Spool,
        plan: SavePlan,
        storage_url: str,
        owner_url: str,
        pool: SlabPool,
        bounce: Bounce | None,
        keep_last: int | None,
    ) -> None:
        self.spool = spool
        self.plan = plan
        self.storage_url = storage_url
        self.owner_url = owner_url
        self.keep_last = keep_last
        self.pool = pool
        self.bounce = bounce
        self.fallback: str | None = None
        self.spooled = 0
        self.spooled_bytes = 0
        self.spool_seconds = 0.0
        """Time spent copying into spool buffers and writing spool files."""
        self.keep = False
        """Leave the save's folder for a later resume (the upload process died)."""
        self._landed: dict[int, Landing] = {}
        self._files: dict[int, Path] = {}
        self._journal: JournalWriter | None = None
        self._journal_ok = True
        self._journal_lock = asyncio.Lock()
        self._over = False  # finish() began: no record may start the journal's folder again
        self._held = 0  # disk budget of files kept until finish()
        self._unsynced: list[Path] = []  # spilled during capture, not fsynced yet
        self._capture_over = False
        self._captured_once: asyncio.Future[None] | None = None  # the attempt to journal 'captured'
        self._root_synced = False  # the spool folder fsynced since this save's folder was made in it
        self._resumable = False
        self.secured = 0
        """Chunks held in RAM that were written to the spool too (on preemption)."""
        spool.active.add(plan.save_id)

    def wants(self) -> bool:
        """Spill this chunk? Always in ``always`` mode; in ``overflow`` when RAM is short."""
        if self.fallback is not None:
            return False
        return self.spool.mode == "always" or (self.bounce is not None and self.pool.would_wait())

    def disk_would_wait(self, nbytes: int) -> bool:
        """True when the disk budget cannot take ``nbytes`` now."""
        return self.spool.budget.used + nbytes > self.spool.budget.capacity

    async def capture(self, chunk: Chunk, copy: Callable[[torch.Tensor], Awaitable[None]]) -> FileChunk | None:
        """Copy ``chunk`` into a buffer, write it to the spool and journal it. None: not
        spilled (no disk budget right now, or the disk failed: then this save falls back to
        RAM)."""
        nbytes = chunk.nbytes
        budget = self.spool.budget
        if self.spool.mode == "always":
            await budget.acquire(nbytes)
        elif not budget.try_acquire(nbytes):
            return None
        ranges = [(p.dst_offset, p.nbytes) for p in chunk.pieces]
        began = time.perf_counter()
        try:
            path, crc, pieces, digests = await self._spill(chunk, copy, ranges)
            self._unsynced.append(Path(path))
            await self._record(
                {"kind": "spooled", "chunk": chunk.index, "crc": crc, "pieces": pieces, "digests": digests}, sync=False
            )  # fmt: skip
        except OSError as exc:
            budget.release(nbytes)
            await asyncio.to_thread(Path(self.spool.save_dir(self.plan.save_id), f"{chunk.index}.bin").unlink, True)
            self.fallback = f"{type(exc).__name__}: {exc}"
            log.warning(
                "aiosnap: spooling step %d to %s failed (%s); this save waits for RAM instead",
                self.plan.step, self.spool.root, self.fallback,
            )  # fmt: skip
            return None
        except BaseException:
            budget.release(nbytes)
            raise
        self.spooled += 1
        self.spooled_bytes += nbytes
        self.spool_seconds += time.perf_counter() - began
        self._files[chunk.index] = Path(path)
        return FileChunk(self.plan.save_id, chunk.index, path, nbytes, crc, tuple(pieces), tuple(digests or ()))

    async def _spill(
        self, chunk: Chunk, copy: Callable[[torch.Tensor], Awaitable[None]], ranges: list[tuple[int, int]]
    ) -> tuple[str, int, list[int], list[str] | None]:
        """Copy the chunk into a slab (``always``) or the bounce slab (``overflow``) and write
        it out; the slab is free again when this returns."""
        if self.spool.mode == "always":
            slab = await self.pool.acquire()
            buffer = self.pool.tensor(slab)

            def give_back() -> None:
                self.pool.release(slab)
        else:
            assert self.bounce is not None
            await self.bounce.lock.acquire()
            buffer = self.bounce.buffer
            give_back = self.bounce.lock.release
        try:
            await copy(buffer)
            return await self.spool.spill(
                self.plan.save_id, chunk.index, bytes_view(buffer)[: chunk.nbytes], ranges, sync=False
            )  # fmt: skip
        finally:
            give_back()

    async def _record(self, record: dict[str, object], *, sync: bool = True) -> None:
        """Append a record, starting the journal (with what has landed so far) if needed.
        OSError when the journal cannot be written. Nothing once the save is over: the
        record would make a new folder after :meth:`finish` removed it. ``sync=False``
        (a chunk spilled during capture): durable with the next synced record, at the
        latest the ``captured`` one (see :meth:`_sync_spilled`)."""
        async with self._journal_lock:
            if self._over:
                return
            if not self._journal_ok:
                raise OSError("the spool journal of this save could not be written earlier")
            try:
                if self._journal is None:
                    folder = self.spool.save_dir(self.plan.save_id)  # made by the first spill, if any
                    await asyncio.to_thread(folder.mkdir, exist_ok=True)
                    self._journal = JournalWriter(folder / JOURNAL)
                    landed = [{"kind": "landed", "chunk": i, **p.record()} for i, p in self._landed.items()]
                    await self._journal.append(self._begin(), *landed, record, sync=sync)
                else:
                    await self._journal.append(record, sync=sync)
            except OSError:
                self._journal_ok = False
                raise

    def _begin(self) -> dict[str, object]:
        return begin_record(
            self.plan.spec, storage_url=self.storage_url, owner_url=self.owner_url, keep_last=self.keep_last
        )

    async def captured(self) -> None:
        """Capture is complete: journal it, before save() returns, so that a crash from here on
        loses nothing that is on disk: when anything went to the spool, in ``always`` mode
        whatever the save holds (a state without tensor bytes is all in its journal), and
        after a preemption in any case (see :meth:`keep_resumable`)."""
        self._capture_over = True
        always = self.spool.mode == "always" and self.fallback is None
        if self._journal is None and not self._resumable and not always:
            return
        await self._journal_captured()

    async def keep_resumable(self) -> None:
        """Preemption: journal this save even if nothing of it is on the spool (every chunk
        landed already, say, and its commit is under way), so that the next process commits
        it if this one is killed first: now if capture is over, else once it is (the chunks
        still in RAM are written by :meth:`secure`)."""
        self._resumable = True
        if self._capture_over:
            await self._journal_captured()

    async def _journal_captured(self) -> None:
        """Journal ``captured`` once, after the files spilled during capture are fsynced.
        Single-flight: a later call (a preemption while those files are fsynced, a chunk
        secured after capture) waits for the first one's end, and never appends the record
        before those fsyncs are done, nor a second one (nor after a failed fsync)."""
        if self._captured_once is not None:
            await asyncio.shield(self._captured_once)
            return
        self._captured_once = asyncio.get_running_loop().create_future()
        try:
            failed = await self._sync_spilled()
            if failed is None and self._journal is not None:  # the save's folder exists: its name first
                failed = await self._sync_spool_root()
            if failed is None:  # (else a writeback error of the disk, EIO or ENOSPC: no 'captured')
                await self._record({"kind": "captured"})
                failed = await self._sync_spool_root()  # (unless done above) that record made the folder
            if failed is not None:
                self._broken(failed[1], f"fsync {failed[0]}")
        except OSError as exc:
            self._broken(exc)
        finally:
            self._captured_once.set_result(None)

    async def _sync_spilled(self) -> tuple[str, OSError] | None:
        """fsync the spool files spilled during capture, then their folder (their names, the
        journal's), before the journal says the save was captured: every file it names is on
        disk by then, as when each was fsynced at once. Until that record a crash discards
        the save however much of it reached the disk (resume needs ``captured``), so the
        spill need not wait for each file's fsync: the disk writes them back meanwhile (see
        :func:`~aiosnap.core.durable.start_writeback`), and the records of the spilled chunks
        become durable with the ``captured`` record's fsync. Returns what could not be
        fsynced, and why (a writeback error of the disk now shows here, not at the spill)."""
        paths, self._unsynced = self._unsynced, []
        if not paths:
            return None
        folder = self.spool.save_dir(self.plan.save_id)

        def sync() -> tuple[str, OSError] | None:
            for path in paths:
                try:
                    durable.fsync_file(path)
                except FileNotFoundError:  # landed meanwhile, and removed
                    continue
                except OSError as exc:
                    return f"the spilled chunk file {path.name}", exc
            try:
                durable.fsync_dir(folder)
            except OSError as exc:
                return f"the spool folder {folder}", exc
            return None

        return await complete_before_cancel(asyncio.to_thread(sync))

    async def _sync_spool_root(self) -> tuple[str, OSError] | None:
        """fsync the spool folder once, after the save's own folder was made in it (by its
        first spill or journal record), so that a crash does not lose that folder's name;
        what could not be fsynced, and why, else None."""
        if self._root_synced:
            return None
        self._root_synced = True
        try:
            await complete_before_cancel(asyncio.to_thread(durable.fsync_dir, self.spool.root))
        except OSError as exc:
            return f"the spool folder {self.spool.root}", exc
        return None

    async def secure(self, chunk: Chunk, data: memoryview) -> bool:
        """Preemption: write ``chunk``, held in RAM as ``data`` (which must not change until
        this returns), to the spool and journal it, so that the save survives this process:
        once every chunk has landed or is on the spool, and capture is over, the next
        process resumes it. False when it was not written (no spool disk budget now, the
        disk or the journal failed, landed already)."""
        index, nbytes = chunk.index, chunk.nbytes
        if not self._journal_ok or index in self._files or index in self._landed:
            return False
        if not self.spool.budget.try_acquire(nbytes):
            log.warning("aiosnap: no spool disk budget left to keep chunk %d of step %d on disk", index, self.plan.step)
            return False
        try:
            path, crc, pieces, digests = await self.spool.spill(
                self.plan.save_id, index, data, [(p.dst_offset, p.nbytes) for p in chunk.pieces]
            )  # fmt: skip
            await self._record({"kind": "spooled", "chunk": index, "crc": crc, "pieces": pieces, "digests": digests})
        except OSError as exc:
            self.spool.budget.release(nbytes)
            log.warning("aiosnap: could not keep chunk %d of step %d on the spool disk: %r", index, self.plan.step, exc)
            return False
        except BaseException:
            self.spool.budget.release(nbytes)
            raise
        self.secured += 1
        if index in self._landed:  # it landed meanwhile: only finish() removes the file now
            self._held += nbytes
        else:
            self._files[index] = Path(path)
        if self._capture_over:
            await self._journal_captured()
        return True

    def _broken(self, exc: OSError, what: str = "write the spool journal") -> None:
        self.fallback = self.fallback or f"{type(exc).__name__}: {exc}"
        log.warning(
            "aiosnap: cannot %s of step %d (%s): the save goes on, but would not survive a crash",
            what, self.plan.step, exc,
        )  # fmt: skip

    async def done_with(self, index: int, pieces: Landing | None) -> None:
        """The transfer side is done with chunk ``index``: landed (``pieces``: its byte
        ranges' places and crc32c; journalled, then its spool file deleted) or dropped (None: the file,
        if any, stays until :meth:`finish`, with its disk budget)."""
        path = self._files.pop(index, None)
        journalled = False
        if pieces is not None:
            self._landed[index] = pieces
            if self._journal is not None and self._journal_ok:
                try:
                    await self._record({"kind": "landed", "chunk": index, **pieces.record()})
                    journalled = True
                except OSError as exc:
                    self._broken(exc)
        if path is None:
            return
        nbytes = self.plan.chunks[index].nbytes
        if journalled:
            await complete_before_cancel(asyncio.to_thread(path.unlink, True))
            self.spool.budget.release(nbytes)
        else:
            self._held += nbytes

    async def finish(self) -> None:
        """The save is over: its spool folder goes (unless :attr:`keep`), its disk budget
        comes back. A record being appended ends first (the lock); none starts after."""
        try:
            async with self._journal_lock:
                self._over = True
            if not self.keep:
                await self.spool.discard(self.plan.save_id)  # also the folder of a save cancelled mid-spill
        finally:
            leftover = self._held + sum(self.plan.chunks[i].nbytes for i in self._files)
            self._files.clear()
            self._held = 0
            if leftover:
                self.spool.budget.release(leftover)
            self.spool.active.discard(self.plan.save_id)
