"""Finishing the saves a crashed process left in the spool (loop thread).

Every leftover journal is untrusted input: it is validated fully (see
:mod:`aiosnap.format.journal`) and must name this checkpointer's own root as its owner
and the root being resumed as its target: a save is resumed only into the root it was
made for, with that root's own retention (never with one a journal states).
A save is resumed only when its journal says capture finished and every chunk either
landed in storage (checked: the object is there, with its size) or is on the spool disk
with the crc32c it was written with; and only when its step is newer than the target's
latest committed step (steps only move forward). Then its spooled chunks are uploaded, its
manifest committed. Leftovers are resumed oldest step first, the objects every leftover's
journal references pinned until the last is done, and retention is applied once after them
all. Anything else is discarded and reported; a save of another root is left alone and
reported as skipped (resume it through a checkpointer of that root:
``ckpt.at(url).resume_spool()``). Saves of this process that are still running
are never touched.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..catalog.pins import pins_for
from ..catalog.steps import apply_retention, latest_committed
from ..core.checksums import file_crc32c_with_pieces
from ..core.events import EventBus, ScopeEmitter
from ..core.progress import counting_sent
from ..errors import AiosnapError, CorruptCheckpointError
from ..format.journal import JOURNAL, JournalError, JournalState, RankPartJournal, read_journal
from ..handoff.spooldir import Spool
from ..storage.base import Storage
from .commit import commit_manifest, whose_commit
from .references import check_references, verify_ranges

__all__ = ["DiscardedLeftover", "Progress", "ResumeReport", "resume_spooled"]

log = logging.getLogger("aiosnap")


@dataclass
class ResumeReport:
    """What a resume found: steps committed, saves discarded (with why), saves that failed."""

    resumed: list[int] = field(default_factory=list)
    discarded: list[tuple[str, str]] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


Progress = Callable[[int, int], None]
"""Called with (bytes just uploaded, bytes to upload in all): once with 0 before the first
upload, then as the requests of the spooled chunks' uploads complete (S3 parts)."""


class _Discard(Exception):
    """This leftover save cannot be resumed; the message says why."""


class DiscardedLeftover(AiosnapError):
    """What a ``resume`` event scope ends with when its leftover save was discarded after
    its resume began (a chunk that landed before the crash is gone from storage)."""


def _journal_of(spool: Spool, save_id: str) -> JournalState:
    path = spool.save_dir(save_id) / JOURNAL
    if not path.exists():
        legacy = spool.save_dir(save_id) / "journal.json"
        if legacy.exists():
            raise _Discard("its journal is of an older aiosnap (journal.json), which this one does not resume")
        raise _Discard("no journal: the process stopped before anything was spooled")
    try:
        return read_journal(path, save_id)
    except RankPartJournal as exc:
        raise _Discard(str(exc)) from None
    except JournalError as exc:
        raise _Discard(f"its journal cannot be trusted: {exc}") from None


def _check_spool_files(spool: Spool, save_id: str, state: JournalState) -> None:
    """Caller's thread (reads files): every chunk landed or spooled intact; the digests the
    journal gives for a spooled chunk's pieces are those of its file's bytes (replaced
    when not: the journal is untrusted input)."""
    if not state.captured:
        raise _Discard("journal does not say capture finished")
    for index, obj in enumerate(state.manifest.objects):
        if index in state.landed:
            continue
        if index not in state.spooled:
            raise _Discard(f"chunk {index} was only in RAM when the process stopped")
        path = spool.save_dir(save_id) / f"{index}.bin"
        if not path.is_file() or path.stat().st_size != obj.nbytes:
            raise _Discard(f"spool file {path} is missing or truncated")
        journalled = state.digests.get(index)
        digested = None if journalled is None else [(p.dst_offset, p.nbytes) for p in state.spec.chunks[index].pieces]
        whole, pieces, digests = file_crc32c_with_pieces(path, state.pieces(index), digested)
        if (whole, pieces) != state.spooled[index]:
            raise _Discard(f"spool file {path} is corrupt (crc32c mismatch)")
        if journalled is not None and digests != journalled:  # the bytes are right (their crc32c): the digests lie
            log.warning(
                "aiosnap: the journal of spooled save %s gives wrong digests for chunk %d: recomputed", save_id, index
            )
            state.digests[index] = list(digests or ())


async def _check_landed(storage: Storage, state: JournalState) -> None:
    """Every chunk the journal calls landed is still in storage, whole (``gc`` may have
    removed an old incomplete step's objects)."""
    for index in sorted(state.landed):
        obj = state.manifest.objects[index]
        expected = state.stored_size(index)
        if expected == 0:  # incremental: every piece is an earlier step's range, no object written
            continue
        try:
            size = await storage.size(obj.name)
        except FileNotFoundError:
            raise _Discard(f"chunk {index} ({obj.name}) landed before the crash but is gone from storage") from None
        if size != expected:
            raise _Discard(f"chunk {index} ({obj.name}) in storage has {size} bytes, not {expected}")
    references = {r for landing in state.landings.values() for r in landing.references}
    try:
        await check_references(storage, state.manifest.step, sorted(references))
    except CorruptCheckpointError as exc:
        raise _Discard(str(exc)) from None


async def _finish(
    spool: Spool, storage: Storage, state: JournalState, concurrency: int, progress: Callable[[int], None]
) -> bool:
    """Upload, commit, and say whether this call committed (False: it was already)."""
    manifest = state.manifest
    latest = await latest_committed(storage)
    if latest is not None and manifest.step <= latest:
        if manifest.step == latest and await whose_commit(storage, latest, manifest.save_id) == "ours":
            return False  # committed just before the crash; only the spool folder was left
        raise _Discard(f"step {manifest.step} is not newer than the latest committed step {latest}")
    try:
        storage.attempt_started(state.spec)
    except ValueError as exc:
        raise _Discard(str(exc)) from None
    references = {r[0] for landing in state.landings.values() for r in landing.references}
    token = pins_for(storage.url).pin(references)  # retention and gc of this process keep them
    try:
        return await _upload_and_commit(spool, storage, state, concurrency, progress)
    finally:
        pins_for(storage.url).release(token)


async def _upload_and_commit(
    spool: Spool, storage: Storage, state: JournalState, concurrency: int, progress: Callable[[int], None]
) -> bool:
    manifest = state.manifest
    await _check_landed(storage, state)
    limit = asyncio.Semaphore(concurrency)
    folder = spool.save_dir(manifest.save_id)

    async def upload(index: int) -> None:
        obj = manifest.objects[index]
        told = 0

        def sent(nbytes: int) -> None:  # a request of this file's upload completed
            nonlocal told
            nbytes = min(nbytes, obj.nbytes - told)
            if nbytes > 0:
                told += nbytes
                progress(nbytes)

        async with limit:
            with counting_sent(sent):
                await storage.write_file(obj.name, str(folder / f"{index}.bin"))
        sent(obj.nbytes - told)  # a backend that reports nothing, or less

    await asyncio.gather(*(upload(i) for i in range(len(manifest.objects)) if i not in state.landed))
    final = state.final_manifest()
    if state.landings:  # an incremental save's journal says where its pieces are: checked, not trusted
        landed = {p.object for landing in state.landings.values() for p in landing.pieces}
        try:
            await verify_ranges(storage, final, landed, concurrency)
        except CorruptCheckpointError as exc:
            raise _Discard(str(exc)) from None
    await commit_manifest(storage, final, replace=False)
    return True


async def resume_spooled(
    spool: Spool,
    storage: Storage,
    *,
    concurrency: int,
    keep_last: int | None,
    owner_url: str | None = None,
    live: set[str] | None = None,
    progress: Progress | None = None,
    events: EventBus | None = None,
) -> ResumeReport:
    """Commit every resumable save in ``spool`` made for ``storage``'s root by the
    checkpointer of ``owner_url`` (default: that same root), with retention ``keep_last``;
    discard the broken ones, skip the others. ``live``: save ids of saves still running
    (never touched). ``events`` hears a ``resume`` scope (start, then end or exception)
    for each leftover save."""
    report = ResumeReport()
    states: dict[str, JournalState | _Discard] = {}
    for save_id in await asyncio.to_thread(spool.leftovers, live or set()):
        try:
            states[save_id] = await asyncio.to_thread(_journal_of, spool, save_id)
        except _Discard as why:
            states[save_id] = why
        except Exception as exc:  # a journal never keeps the checkpointer from starting
            log.error("aiosnap: reading the journal of spooled save %s failed (kept): %r", save_id, exc)
            report.failed.append((save_id, f"{type(exc).__name__}: {exc}"))
    total = sum(
        s.manifest.objects[i].nbytes
        for s in states.values()
        if isinstance(s, JournalState) and s.begin.storage_url == storage.url
        for i in range(len(s.manifest.objects))
        if i not in s.landed
    )

    def landed(nbytes: int) -> None:
        if progress is not None:
            progress(nbytes, total)

    landed(0)  # the total, before the first byte: a progress bar knows what to expect from the start

    owner = storage.url if owner_url is None else owner_url
    mine: list[tuple[str, JournalState | _Discard]] = []
    for save_id, state in sorted(states.items(), key=_in_step_order):
        if isinstance(state, JournalState):
            if state.begin.owner_url != owner:
                report.skipped.append((save_id, f"belongs to the checkpointer of {state.begin.owner_url}"))
                continue
            if state.begin.storage_url != storage.url:
                report.skipped.append((save_id, f"belongs to {state.begin.storage_url}"))
                continue
        elif owner != storage.url:
            continue  # an unreadable leftover is judged by the checkpointer's own root only
        mine.append((save_id, state))
    pending = {r[0] for _, s in mine if isinstance(s, JournalState) for landing in s.landings.values()
               for r in landing.references}  # fmt: skip
    token = pins_for(storage.url).pin(pending)  # a later leftover's references outlive an earlier's commit
    try:
        for save_id, state in mine:
            step = state.manifest.step if isinstance(state, JournalState) else None
            emit = None if events is None else events.scope("resume", step, storage.url, save_id)
            await _resume_one(spool, storage, save_id, state, concurrency, report, landed, emit)
    finally:
        pins_for(storage.url).release(token)
    if report.resumed:  # once, after every leftover: the pins are gone, the newest step names what it uses
        newest = max(report.resumed)
        try:
            await apply_retention(storage, keep_last, newest, set())  # keeps what kept steps name
        except Exception as exc:
            log.warning("aiosnap: retention after resuming step %d failed: %r", newest, exc)
    return report


def _in_step_order(item: tuple[str, JournalState | _Discard]) -> tuple[int, int, str]:
    """Leftovers resumed oldest step first (an unreadable one last): steps only move forward,
    so a newer step resumed first would make every older one not newer than the latest."""
    save_id, state = item
    if isinstance(state, JournalState):
        return 0, state.manifest.step, save_id
    return 1, 0, save_id


async def _resume_one(
    spool: Spool,
    storage: Storage,
    save_id: str,
    state: JournalState | _Discard,
    concurrency: int,
    report: ResumeReport,
    landed: Callable[[int], None],
    emit: ScopeEmitter | None,
) -> None:
    """Resume or discard one leftover save (see the module docstring)."""
    started = time.perf_counter()
    scope = None  # a leftover discarded before anything of it is resumed gets no scope: only its log line
    try:
        if isinstance(state, _Discard):
            raise state
        await asyncio.to_thread(_check_spool_files, spool, save_id, state)
        scope = emit
        if scope is not None:
            scope("start")
        committed = await _finish(spool, storage, state, concurrency, landed)
    except _Discard as why:
        log.warning("aiosnap: discarding spooled save %s: %s", save_id, why)
        report.discarded.append((save_id, str(why)))
        if scope is not None:
            scope("exception", exception=DiscardedLeftover(str(why)))
        await spool.discard(save_id)
        return
    except Exception as exc:  # kept for the next attempt; the caller reports it
        log.error("aiosnap: resuming spooled save %s failed (kept for later): %r", save_id, exc)
        report.failed.append((save_id, f"{type(exc).__name__}: {exc}"))
        if emit is not None:
            if scope is None:
                emit("start")
            emit("exception", exception=exc)
        return
    step = state.manifest.step
    if emit is not None:
        emit("end", nbytes=state.manifest.total_bytes, seconds=time.perf_counter() - started)
    if committed:
        log.info("aiosnap: resumed and committed step %d of %s from spool %s", step, storage.url, Path(spool.root))
        report.resumed.append(step)
    await spool.discard(save_id)
