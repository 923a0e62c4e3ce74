"""Writing planned safetensors shards to storage, with no local staging.

Every shard file is one object written in parts (:meth:`~aiosnap.storage.base.Storage.start_upload`):
on S3 one multipart upload whose parts go as soon as their bytes are filled, locally a
temporary file beside the final name written at offsets in parallel and renamed at the end.
Parts are filled by the caller's ``fill`` (the header by the writer itself), at most
``concurrency`` at a time and never more bytes than ``budget`` allows. So:

- no shard is ever visible under its final name half-written (an upload becomes the object
  only when completed; a file only when renamed);
- the index, ``model.safetensors.index.json``, is written last, once every shard is whole:
  a folder with an index is complete;
- a failure aborts every upload still open and removes the shards this export completed,
  or began to complete (a rename or CompleteMultipartUpload cut short by a cancel may have
  landed), and the index if its write began (best effort), then raises the original error.

The three phases (:meth:`ShardUploads.start`, :meth:`ShardUploads.write`,
:meth:`ShardUploads.finish`) can run in different processes of one job: the tokens
:meth:`~ShardUploads.start` returns and the part records :meth:`~ShardUploads.write` returns
are JSON-able, so ranks share them (one upload per shard, parts by different ranks).
No torch; runs on whichever event loop calls it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from ...core.aio import run_all
from ...core.budget import ByteBudget
from ...storage.base import PartRecord, Storage
from .destination import Claim
from .layout import INDEX_FILE, ExportTensor, Shard, index_document, part_ranges

__all__ = ["Fill", "Part", "Segment", "ShardUploads", "write_shards"]

log = logging.getLogger("aiosnap")

Segment = tuple[ExportTensor, int, int, memoryview]
"""Bytes ``[start, end)`` of a tensor (as exported: its dtype, row-major) and where they go."""
Fill = Callable[[list[Segment]], Awaitable[None]]
"""``fill(segments)``: put each segment's bytes into its buffer (the tensor parts of one
part of a file, so that the filler can read its sources with few requests)."""


@dataclass(frozen=True)
class Part:
    """Part ``number`` (from 1) of shard ``shard``: bytes ``[start, end)`` of its file."""

    shard: int
    number: int
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class ShardUploads:
    """The uploads of one export's shards under ``folder`` of ``storage`` (``""``: its root)."""

    def __init__(self, storage: Storage, shards: Sequence[Shard], folder: str = "") -> None:
        self.storage = storage
        self.shards = list(shards)
        self.folder = folder.strip("/")
        self.tokens: list[str | None] = [None] * len(self.shards)
        self.completing: list[bool] = [False] * len(self.shards)
        """Shards whose completion began: each may be whole under its name (even when the
        call was cancelled or failed: a rename or CompleteMultipartUpload may have landed)."""
        self.index_started = False

    def name(self, file: str) -> str:
        return f"{self.folder}/{file}" if self.folder else file

    def parts(self) -> list[Part]:
        """Every part of every shard, in file order (the part size the storage asks for)."""
        found = []
        for index, shard in enumerate(self.shards):
            size = shard.size
            for number, (start, end) in enumerate(part_ranges(size, self.storage.part_size_for(size)), start=1):
                found.append(Part(index, number, start, end))
        return found

    async def start(self) -> list[str]:
        """Begin one upload per shard; their tokens, in shard order (a failure part way
        aborts those begun)."""
        try:
            for index, shard in enumerate(self.shards):
                self.tokens[index] = await self.storage.start_upload(self.name(shard.file))
        except BaseException:
            await asyncio.shield(self.abort())
            raise
        return [t for t in self.tokens if t is not None]

    def adopt(self, tokens: Sequence[str]) -> None:
        """Write parts of uploads another process started (its :meth:`start`'s tokens)."""
        if len(tokens) != len(self.shards):
            raise ValueError(f"{len(tokens)} upload tokens for {len(self.shards)} shards")
        self.tokens = list(tokens)

    async def write(
        self, parts: Iterable[Part], fill: Fill, *, concurrency: int, budget: ByteBudget,
        progress: Callable[[int], None] | None = None,
    ) -> list[tuple[int, PartRecord]]:  # fmt: skip
        """Fill and upload ``parts``, at most ``concurrency`` at a time within ``budget``;
        returns (shard, record) for each."""
        records: list[tuple[int, PartRecord]] = []
        limit = asyncio.Semaphore(concurrency)

        async def one(part: Part) -> None:
            async with limit, budget.reserve(part.nbytes):
                buffer = memoryview(bytearray(part.nbytes))
                await self._fill(part, buffer, fill)
                shard = self.shards[part.shard]
                token = self.tokens[part.shard]
                assert token is not None, "start() or adopt() first"
                record = await self.storage.upload_part(self.name(shard.file), token, part.number, part.start, buffer)
            records.append((part.shard, record))
            if progress is not None:
                progress(part.nbytes)

        await run_all(one(part) for part in parts)
        return records

    async def _fill(self, part: Part, buffer: memoryview, fill: Fill) -> None:
        """The file's bytes ``[part.start, part.end)``: header bytes, then each tensor's."""
        shard = self.shards[part.shard]
        head = shard.header[part.start : part.end]
        buffer[: len(head)] = head
        segments: list[Segment] = []
        for placed in shard.tensors:
            lo, hi = max(part.start, placed.offset), min(part.end, placed.end)
            if lo < hi:
                dest = buffer[lo - part.start : hi - part.start]
                segments.append((placed.tensor, lo - placed.offset, hi - placed.offset, dest))
        if segments:
            await fill(segments)

    async def finish(self, records: Iterable[tuple[int, PartRecord]], claim: Claim | None = None) -> None:
        """Complete every shard's upload from all its parts' records, then (``claim``
        still held, when given) write the index."""
        by_shard: dict[int, list[PartRecord]] = {index: [] for index in range(len(self.shards))}
        for index, record in records:
            by_shard[index].append(record)
        for index, shard in enumerate(self.shards):
            token = self.tokens[index]
            assert token is not None
            self.completing[index] = True  # before the call: it may land however it ends
            await self.storage.complete_upload(self.name(shard.file), token, by_shard[index])
        if claim is not None:
            try:
                await claim.check()
            except FileExistsError:
                self.completing = [False] * len(self.shards)  # the names may be the new owner's now: leave them
                raise
        self.index_started = True
        await self.storage.write(self.name(INDEX_FILE), index_document(self.shards))

    async def abort(self) -> None:
        """Remove every trace of this export (best effort: the failure that got us here is
        what the caller must see): the index if its write began, then each shard whose
        completion began, and every upload still open."""
        names = [INDEX_FILE] if self.index_started else []
        names += [shard.file for index, shard in enumerate(self.shards) if self.completing[index]]
        for file in names:
            await self._quietly(file, self.storage.delete(self.name(file)))
        for shard, token in zip(self.shards, self.tokens, strict=True):
            if token is not None:
                await self._quietly(shard.file, self.storage.abort_upload(self.name(shard.file), token))

    async def _quietly(self, file: str, work: Awaitable[None]) -> None:
        try:
            await work
        except Exception as exc:
            log.warning("aiosnap: %s: could not remove %s of a failed export: %r", self.storage.url, file, exc)


async def write_shards(
    storage: Storage,
    shards: Sequence[Shard],
    fill: Fill,
    *,
    folder: str = "",
    concurrency: int = 8,
    budget: ByteBudget,
    progress: Callable[[int], None] | None = None,
    claim: Claim | None = None,
) -> None:
    """Write ``shards`` (and their index, last, ``claim`` checked first when given) under
    ``folder`` of ``storage`` in one process: see the module docstring."""
    uploads = ShardUploads(storage, shards, folder)
    try:
        await uploads.start()
        records = await uploads.write(uploads.parts(), fill, concurrency=concurrency, budget=budget, progress=progress)
        await uploads.finish(records, claim)
    except BaseException:
        await asyncio.shield(uploads.abort())
        raise
