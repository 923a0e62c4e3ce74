"""Base ranges an incremental save names only once their stored bytes are known good (loop).

A committed manifest's crc32c says what a range held when it was written, not what storage
holds now: a range that rotted after its commit (a flipped bit on disk, a bad replica)
would be named by every later incremental save, while retention deletes the steps that
still had good copies. So a save names a base range only once this transfer side knows
its stored bytes: it wrote and checksummed them itself (every range it lands is recorded
here, with every field its manifest records for it), or it read them back once, when a
save of its first took that base, and found both their crc32c and their xxh3-128 digest.
A long-running job reads nothing extra; the first save after a restart (or on another
writer's step) reads the raw base ranges it names once, in the upload workers (after
``save()`` returned), through buffers of :data:`READ_BUFFER_BYTES`,
:data:`READ_CONCURRENCY` at a time per save.

A compressed base range that this transfer side did not write is never named: checking it
would take decompressing it whole (its byte shuffle spans the range), and its frame's own
crc32c says nothing of its codec fields (a manifest whose shuffle was edited, or whose frame
was swapped with its crc32c, would be named by every later save and load by none). The save
writes those bytes again, once; the saves after it name what it wrote.

A range that fails its check, or lies in an object whose size is not the one its manifest
records (truncated), is not named: the save writes those bytes again (one WARNING naming the
step and object); no save fails because of it.
"""

from __future__ import annotations

import asyncio
import logging

import xxhash

from ..core.checksums import crc32c_of
from ..format.placement import BaseRanges, Landing, Placed, Reference, Reuse
from ..format.spec import ChunkSpec
from ..storage.base import Storage

__all__ = ["READ_BUFFER_BYTES", "READ_CONCURRENCY", "CheckedRanges", "CheckedReuse", "RangeKey", "stored_key"]

log = logging.getLogger("aiosnap")

READ_BUFFER_BYTES = 1 << 20
"""The buffer each read-back streams a range through (never the range whole)."""

READ_CONCURRENCY = 4
"""Ranges one save reads back at once (at most this many buffers in memory)."""

RangeKey = tuple[Placed, int]
"""A stored range: every field a manifest records for it, and its raw size. Two ranges are
the same only when all of them are (an edited shuffle or crc32c is another range)."""


def stored_key(placed: Placed, nbytes: int) -> RangeKey:
    """The key of ``placed`` (``nbytes`` raw bytes)."""
    return placed, nbytes


class CheckedRanges:
    """Per storage root, the stored ranges this transfer side knows to hold their crc32c
    (True) or not to (False): those it wrote itself, those it read back. Kept to what the
    latest base can name: :meth:`adopt` drops the rest. Transfer loop."""

    def __init__(self) -> None:
        self._by_root: dict[str, dict[RangeKey, bool]] = {}

    def known(self, url: str, key: RangeKey) -> bool | None:
        return self._by_root.get(url, {}).get(key)

    def record(self, url: str, key: RangeKey, good: bool) -> None:
        self._by_root.setdefault(url, {})[key] = good

    def wrote(self, url: str, chunk: ChunkSpec, landing: Landing) -> None:
        """``landing`` was just written (checksummed as it went) by this transfer side:
        its own pieces are known good."""
        for piece, placed in zip(chunk.pieces, landing.pieces, strict=True):
            if placed.object == chunk.object_name:
                self.record(url, stored_key(placed, piece.nbytes), True)

    def adopt(self, url: str, base: BaseRanges) -> None:
        """A save takes ``base`` on ``url``: forget what it cannot name (what the next
        saves can name is what this one names and what it writes)."""
        found = self._by_root.get(url, {})
        keys = {stored_key(p, nbytes) for (nbytes, _), places in base.by_content.items() for p in places}
        self._by_root[url] = {key: found[key] for key in keys & found.keys()}


class CheckedReuse:
    """One save's use of its base (``reuse``), naming a range only once its stored bytes
    are known good, read back from ``storage`` when they are not known yet (transfer loop).
    ``step``: the step being saved (for the warning)."""

    def __init__(self, storage: Storage, reuse: Reuse, checked: CheckedRanges, step: int) -> None:
        self.storage = storage
        self.reuse = reuse
        self.checked = checked
        self.step = step
        self._limit = asyncio.Semaphore(READ_CONCURRENCY)
        self._reading: dict[RangeKey, asyncio.Task[bool]] = {}
        self._said_compressed = False
        self._sized: dict[str, asyncio.Task[bool]] = {}
        """Per base object read back: it has the size its manifest records (the commit's
        reference check compares that size too: a truncated object is never named)."""

    async def take(self, nbytes: int, digest: str, crc32c: int) -> tuple[Placed, Reference] | None:
        """A base range of ``nbytes`` bytes with ``digest`` and ``crc32c``, not named yet
        by this save and known good, and the object it lies in (None: write the piece)."""
        for placed in self.reuse.candidates(nbytes, digest, crc32c):
            if await self._holds(placed, nbytes):
                found = self.reuse.claim(placed)
                if found is not None:
                    return found
        return None

    def wrote(self, chunk: ChunkSpec, landing: Landing) -> None:
        """See :meth:`CheckedRanges.wrote`."""
        self.checked.wrote(self.storage.url, chunk, landing)

    async def _holds(self, placed: Placed, nbytes: int) -> bool:
        key = stored_key(placed, nbytes)
        known = self.checked.known(self.storage.url, key)
        if known is not None:
            return known
        task = self._reading.get(key)
        if task is None:  # one read per range, however many pieces ask
            task = self._reading[key] = asyncio.ensure_future(self._read_back(key))
        return await task

    async def _whole(self, name: str) -> bool:
        """``name`` has the size the base manifest records (one size request per object)."""
        task = self._sized.get(name)
        if task is None:
            task = self._sized[name] = asyncio.ensure_future(self._size_matches(name))
        return await task

    async def _size_matches(self, name: str) -> bool:
        recorded = self.reuse.base.objects[name].nbytes if name in self.reuse.base.objects else None
        size = await self.storage.size(name)
        if size != recorded:
            log.warning(
                "aiosnap: step %d: object %r of its base step %d has %d bytes, not the %s its manifest records "
                "(truncated in storage?); this save writes its ranges again", self.step, name, self.reuse.base.step,
                size, recorded,
            )  # fmt: skip
        return size == recorded

    async def _read_back(self, key: RangeKey) -> bool:
        placed, size = key
        name, offset = placed.object, placed.offset
        if placed.stored is not None:  # compressed by another transfer side: never named (module docstring)
            if not self._said_compressed:
                self._said_compressed = True
                log.info(
                    "aiosnap: step %d: the compressed ranges of its base step %d were not written by this process; "
                    "this save writes them again (once)", self.step, self.reuse.base.step,
                )  # fmt: skip
            return False
        async with self._limit:
            try:
                good = await self._whole(name) and await _stored_sums(self.storage, name, offset, size) == (
                    placed.crc32c, placed.digest,
                )  # fmt: skip
            except FileNotFoundError:
                good = False
            except Exception as exc:  # not known either way: not named this time, asked again next save
                log.warning(
                    "aiosnap: step %d: reading back %d bytes at %d of %r (of its base step %d) failed (%r); "
                    "this save writes them again", self.step, size, offset, name, self.reuse.base.step, exc,
                )  # fmt: skip
                return False
        if not good:
            log.warning(
                "aiosnap: step %d: %d bytes at %d of %r (of its base step %d) do not match the crc32c and digest "
                "recorded for them (rotted in storage?); this save writes them again",
                self.step, size, offset, name, self.reuse.base.step,
            )  # fmt: skip
        self.checked.record(self.storage.url, key, good)
        return good


async def _stored_sums(storage: Storage, name: str, offset: int, size: int) -> tuple[int, str] | None:
    """The crc32c and the xxh3-128 digest (hex) of the ``size`` stored bytes at ``offset`` of
    ``name``, streamed through one buffer of at most :data:`READ_BUFFER_BYTES` (None: the
    object ends early). Both: a crc32c is easily forged together with the bytes it covers."""
    buffer = memoryview(bytearray(min(size, READ_BUFFER_BYTES)))
    digest = xxhash.xxh3_128()
    crc = done = 0

    def add(data: memoryview, crc: int) -> int:  # a worker thread (both release the GIL)
        digest.update(data)
        return crc32c_of(data, crc)

    while done < size:
        want = buffer[: min(len(buffer), size - done)]
        got = await storage.read_into(name, offset + done, want)
        if got != len(want):
            return None
        crc = await asyncio.to_thread(add, want, crc)
        done += got
    return crc, digest.hexdigest()
