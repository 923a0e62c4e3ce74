"""Stored byte ranges for a converter's fills, within a RAM budget: read once while needed,
verified, every byte charged.

A fill (the tensor bytes of one part of an output file) asks :meth:`RangeCache.get` for the
stored ranges it copies from, each with the stretch ``[lo, hi)`` of the range it needs.
A range of at most half the budget is read whole, verified, and kept while the budget
allows (least recently used go first), so the parts of a file, filled in order, find the
ranges the part before them read (a compressed range always is, its frame and scratch
charged too). A larger range is *streamed*: the first time, read whole
in windows of :attr:`RangeCache.window` bytes, its crc32c computed across all of them, only
the stretch the fill needs kept; after that (and for a range that records no crc32c at
all) only the stretch a fill needs is read. So a range larger than the budget allows costs
about twice its bytes in reads, and every byte is verified once as it comes from storage.

Every byte a fill holds or reads is reserved from :attr:`RangeCache.budget` before it is
allocated: fills are admitted one at a time (an admission waits, holding nothing, while
the budget is full; fills already admitted never wait for it, so they finish and give
bytes back), and a fill that needs more than the whole budget is refused with a clear
error. Loop thread; the checksums run in worker threads.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...core.aio import complete_before_cancel
from ...core.budget import ByteBudget
from ...core.checksums import crc32c_of
from ...errors import AiosnapError, ChecksumMismatchError, CorruptCheckpointError, TruncatedObjectError
from ...format.manifest import ByteRange
from ...load.fetch_runs import Range, plan_runs, read_run
from ...storage.base import Storage

__all__ = ["Held", "RangeCache", "Want"]

Key = tuple[str, int]
WINDOW = 4 * 1024**2
"""Largest window a streamed range is read in."""


@dataclass(frozen=True)
class Want:
    """Bytes ``[lo, hi)`` of stored range ``where`` (of the entry at ``path``)."""

    path: str
    where: ByteRange
    lo: int
    hi: int

    @property
    def key(self) -> Key:
        return (self.where.object, self.where.offset)


@dataclass
class _Entry:
    """A range read whole: its bytes once read, and how many admitted fills use it."""

    nbytes: int
    ready: asyncio.Future[bytearray]
    users: int = 0


@dataclass
class Held:
    """What one fill got: for each range, its bytes and the offset in the range they start
    at. Give it back with :meth:`RangeCache.release`."""

    data: dict[Key, tuple[bytearray, int]] = field(default_factory=dict)
    pinned: list[Key] = field(default_factory=list)
    private: int = 0
    """Bytes of streamed stretches (and their windows) charged to this fill alone."""


def _inflating(r: ByteRange) -> int:
    """What reading compressed range ``r`` holds at once: its raw bytes and its frame
    (:func:`~aiosnap.core.codec.decompress_into` unshuffles through a small fixed scratch).
    A compressed range is always read whole through :func:`~aiosnap.load.fetch_runs.read_run`:
    its raw bytes are not at offsets of its object that windows could read."""
    return r.nbytes + r.extent


class RangeCache:
    """Verified stored ranges of ``storage`` for fills, within ``limit`` bytes (see the
    module docstring). Loop thread."""

    def __init__(self, storage: Storage, where: str, limit: int) -> None:
        self.storage = storage
        self.where = where
        self.budget = ByteBudget(max(limit, 64 * 1024), f"{where}: ram_budget for source ranges")
        self.window = max(min(WINDOW, self.budget.capacity // 4), 1)
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()
        self._admit = asyncio.Lock()
        self._hungry = False
        self._verified: set[Key] = set()
        """Streamed ranges already read whole once and verified."""
        self.bytes_read = 0

    def _choose(self, wants: Sequence[Want]) -> tuple[int, set[Key]]:
        """(new bytes ``wants`` take, the ranges to read whole): ranges not held yet are read
        whole when at most half the budget, the largest streamed instead while the fill
        would not fit; a streamed stretch costs its bytes, and one window is read at a time."""
        missing = [w for w in wants if w.key not in self._entries]
        inflated = [w for w in missing if w.where.codec is not None]  # never streamed: see _inflating
        whole = sorted(
            (w for w in missing if w.where.codec is None and w.where.nbytes <= self.budget.capacity // 2),
            key=lambda w: w.where.nbytes,
        )
        while True:
            chosen = {w.key for w in whole} | {w.key for w in inflated}
            streamed = [w for w in missing if w.key not in chosen]
            window = min(self.window, max((w.where.nbytes for w in streamed), default=0))
            cost = sum(w.where.nbytes for w in whole) + sum(w.hi - w.lo for w in streamed) + window
            cost += sum(_inflating(w.where) for w in inflated)
            if cost <= self.budget.capacity or not whole:
                return cost, chosen
            whole.pop()

    def _make_room(self, nbytes: int) -> None:
        """Drop ranges no fill uses (least recently used first) until ``nbytes`` fit."""
        for key in [k for k, e in self._entries.items() if e.users == 0 and e.ready.done()]:
            if self.budget.used + nbytes <= self.budget.capacity:
                return
            self._drop(key)

    def _drop(self, key: Key) -> None:
        entry = self._entries.pop(key)
        self.budget.release(entry.nbytes)

    async def get(self, wants: Sequence[Want]) -> Held:
        """The bytes of every wanted stretch (merged by range), each range verified."""
        merged: dict[Key, Want] = {}
        for w in wants:
            old = merged.get(w.key)
            merged[w.key] = w if old is None else Want(w.path, w.where, min(old.lo, w.lo), max(old.hi, w.hi))
        wanted = list(merged.values())
        held = Held()
        mine: dict[Key, _Entry] = {}
        async with self._admit:
            granted = 0
            while True:
                cost, whole = self._choose(wanted)
                if cost > self.budget.capacity:
                    raise AiosnapError(
                        f"{self.where}: one part needs {cost} bytes of source ranges, more than the "
                        f"{self.budget.capacity} the RAM budget leaves for them: raise ram_budget"
                    )
                if cost <= granted:
                    break
                self._make_room(cost - granted)
                self._hungry = True
                try:
                    await self.budget.acquire(cost - granted)
                finally:
                    self._hungry = False
                granted = cost
            self.budget.release(granted - cost)
            loop = asyncio.get_running_loop()
            for w in wanted:
                entry = self._entries.get(w.key)
                if entry is None and w.key in whole:
                    entry = mine[w.key] = self._entries[w.key] = _Entry(w.where.nbytes, loop.create_future())
                if entry is not None:
                    entry.users += 1
                    self._entries.move_to_end(w.key)
                    held.pinned.append(w.key)
            held.private = cost - sum(e.nbytes for e in mine.values())
        try:
            await self._read_whole([w for w in wanted if w.key in mine], mine)
            for w in wanted:
                if w.key in held.pinned:
                    held.data[w.key] = (await asyncio.shield(self._entries[w.key].ready), 0)
                else:
                    held.data[w.key] = (await self._stream(w), w.lo)
        except BaseException:
            self.release(held)
            raise
        return held

    async def _read_whole(self, wants: list[Want], mine: dict[Key, _Entry]) -> None:
        """Read this fill's new whole ranges (neighbours of one object with one request)."""
        buffers = {key: bytearray(entry.nbytes) for key, entry in mine.items()}
        try:
            for run in plan_runs([Range(w.path, w.where, memoryview(buffers[w.key])) for w in wants]):
                await read_run(self.storage, self.where, run)
                self.bytes_read += run.end - run.start
        except BaseException as exc:
            for key, entry in mine.items():
                if self._entries.get(key) is entry:
                    self._drop(key)
                if not entry.ready.done():
                    entry.ready.set_exception(exc)
                    entry.ready.exception()  # seen by those waiting, if any
            raise
        for key, entry in mine.items():
            entry.ready.set_result(buffers[key])

    async def _stream(self, want: Want) -> bytearray:
        """Bytes ``[lo, hi)`` of a range read in windows, the whole range verified."""
        r = want.where
        if r.codec is not None:
            raise AssertionError("a compressed range is read whole, never streamed")
        out = bytearray(want.hi - want.lo)
        if r.crc32c is None or want.key in self._verified:  # nothing (more) to verify: read what is needed
            await self._read_exactly(want, want.lo, memoryview(out))
            return out
        window = bytearray(min(self.window, r.nbytes))
        crc = 0
        for at in range(0, r.nbytes, len(window)):
            n = min(len(window), r.nbytes - at)
            view = memoryview(window)[:n]
            await self._read_exactly(want, at, view)
            crc = await complete_before_cancel(asyncio.to_thread(crc32c_of, view, crc))
            lo, hi = max(at, want.lo), min(at + n, want.hi)
            if lo < hi:
                out[lo - want.lo : hi - want.lo] = view[lo - at : hi - at]
        if crc != r.crc32c:
            raise ChecksumMismatchError(
                f"{self.where}: checksum mismatch in {want.path!r} (object {r.object!r}, offset {r.offset}): "
                f"crc32c {crc:#010x}, manifest says {r.crc32c:#010x}"
            )
        self._verified.add(want.key)
        return out

    async def _read_exactly(self, want: Want, at: int, dest: memoryview) -> None:
        """Bytes ``at`` onwards of ``want``'s range into ``dest``, all of them."""
        r = want.where
        try:
            got = await self.storage.read_into(r.object, r.offset + at, dest)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"{self.where}: data object {r.object!r} of {want.path!r} is missing") from exc
        if got < len(dest):
            raise TruncatedObjectError(
                f"{self.where}: data object {r.object!r} is truncated: {want.path!r} needs {r.nbytes} bytes at "
                f"offset {r.offset}"
            )
        self.bytes_read += len(dest)

    def release(self, held: Held) -> None:
        """Give back what :meth:`get` returned (its copies are done)."""
        for key in held.pinned:
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.users -= 1
            if entry.users == 0 and (self._hungry or (entry.ready.done() and entry.ready.exception() is not None)):
                self._drop(key)  # an admission waits for room: make it now
        held.pinned.clear()
        held.data.clear()  # the bytes go now, not when the caller's variable does
        if held.private:
            self.budget.release(held.private)
            held.private = 0
