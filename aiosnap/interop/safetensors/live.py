"""Live export at save time: ``save(state, step=..., also_as="safetensors")`` also writes the
Hugging Face layout of the chosen tensors, from the same capture, committed with the step.

The export goes to ``<step>/<save id>/safetensors/`` of the checkpoint's own root (see
:func:`live_export_folder`): inside the save's attempt folder, so it is there exactly when
the step is committed, retention deletes it with the step, and ``aiosnap gc`` treats it as
part of the step. Its shards and index are written before the step's manifest: a committed
step with ``also_as`` always has its whole export.

How (transfer side, no torch, on the transfer side's loop): the shards are planned from the
save's spec (the tensors in the order the save captures them); each shard is one object
written in parts (one multipart upload on S3). As each captured chunk is uploaded, the
bytes of its exported pieces are copied, before the chunk's slab goes back, into the
buffers of the parts they belong to (header bytes are put there when a part's buffer is
made); a part whose every byte has arrived is uploaded and its buffer dropped. So parts go
out while the save uploads. The part buffers are bounded: past ``memory`` bytes (a quarter
of ``ram_budget``, at least two parts) a chunk's upload waits for part uploads to finish,
holding its slab, so a slow destination slows the save through its own RAM budget instead
of piling up parts; the parts still being filled are about ``upload.concurrency`` chunks'
worth more (chunks are captured and uploaded in plan order).
A failure of the export fails the save (before its commit); the uploads are aborted.

Not done: a multi-rank save, a single-file checkpoint, and dtype conversion (the transfer
side has no torch) are refused when ``save()`` is called; a save resumed from the spool
after a crash commits without its export (``aiosnap export`` writes it afterwards).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import mmap
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from ...config import parse_size
from ...core.aio import complete_before_cancel
from ...core.names import attempt_prefix
from ...format.spec import AlsoSpec, SaveSpec
from ...storage.base import PartRecord, Storage
from .header import CODE_OF_AIOSNAP
from .layout import ExportTensor, Shard, map_names, plan_shards
from .writer import Part, ShardUploads

__all__ = ["LIVE_FOLDER", "LiveExport", "SafetensorsExport", "also_spec", "live_export_folder", "plan_live"]

LIVE_FOLDER = "safetensors"


@dataclass(frozen=True)
class SafetensorsExport:
    """What a live export writes: the tensors whose aiosnap path matches ``paths`` (all by
    default), named by stripping ``strip`` (see :func:`~.layout.hf_name`), in shards of at
    most ``max_shard_size`` tensor bytes, ``metadata`` in every header."""

    paths: Sequence[str] | None = None
    strip: str = "model/"
    max_shard_size: int | str = "5GB"
    metadata: dict[str, str] | None = None

    def spec(self) -> AlsoSpec:
        return AlsoSpec(
            format="safetensors", paths=None if self.paths is None else tuple(self.paths), strip=self.strip,
            max_shard_size=parse_size(self.max_shard_size), metadata=dict(self.metadata or {}),
        )  # fmt: skip


def also_spec(also_as: str | SafetensorsExport) -> AlsoSpec:
    """Caller's thread: what ``save(..., also_as=...)`` asks for, as the save spec keeps it."""
    if isinstance(also_as, SafetensorsExport):
        return also_as.spec()
    if also_as == "safetensors":
        return SafetensorsExport().spec()
    raise ValueError(f"also_as={also_as!r}: 'safetensors' or a SafetensorsExport(...)")


def live_export_folder(step: int, save_id: str) -> str:
    """Root-relative folder of the live export of one committed save."""
    return f"{attempt_prefix(step, save_id)}/{LIVE_FOLDER}"


def plan_live(spec: SaveSpec) -> list[Shard]:
    """The shards of ``spec``'s live export; ValueError for what a live export cannot do
    (called on the caller's thread by ``save()`` to refuse early, and again on the transfer side)."""
    also = spec.also
    if also is None or also.format != "safetensors":
        raise ValueError(f"step {spec.step}: no safetensors export asked for")
    if spec.distributed is not None or spec.world_size > 1:
        raise ValueError(
            "also_as='safetensors' works for one-process saves; export a multi-rank step with aiosnap export"
        )
    if spec.archive is not None:
        raise ValueError("also_as='safetensors' needs a checkpoint folder, not a single-file checkpoint")
    chosen = [
        (index, e)
        for index, e in enumerate(spec.entries)
        if e.kind == "tensor" and (also.paths is None or any(fnmatchcase(e.path, p) for p in also.paths))
    ]
    if not chosen:
        raise ValueError(f"also_as='safetensors': no tensor of the state matches {list(also.paths or ['*'])!r}")
    names = map_names([e.path for _, e in chosen], None, also.strip)
    tensors = []
    for index, e in chosen:
        code = CODE_OF_AIOSNAP.get(e.dtype)
        if code is None:
            raise ValueError(
                f"{e.path!r}: safetensors cannot hold {e.dtype} tensors (leave it out of the export paths)"
            )
        tensors.append(ExportTensor(names[e.path], code, tuple(e.shape), index))
    return plan_shards(tensors, also.max_shard_size, also.metadata, aligned=False)


class _Filling:
    """A part of a shard being filled (its buffer made when its first byte arrives)."""

    def __init__(self, part: Part, header: bytes) -> None:
        self.part = part
        self.header = header[part.start : part.end]
        self.buffer: bytearray | None = None
        self.missing = part.nbytes - len(self.header)

    def buffer_now(self) -> bytearray:
        if self.buffer is None:
            self.buffer = bytearray(self.part.nbytes)
            self.buffer[: len(self.header)] = self.header
        return self.buffer


class LiveExport:
    """One save's live export on the transfer side (its loop; copies on worker threads)."""

    def __init__(
        self, storage: Storage, spec: SaveSpec, *, part_concurrency: int = 8, memory: int = 256 * 1024**2
    ) -> None:
        self.spec = spec
        self.shards = plan_live(spec)
        self.uploads = ShardUploads(storage, self.shards, live_export_folder(spec.step, spec.save_id))
        self.places = {t.tensor.source: (s, t.offset) for s, shard in enumerate(self.shards) for t in shard.tensors}
        self.filling = [_Filling(p, self.shards[p.shard].header) for p in self.uploads.parts()]
        self.starts: list[list[int]] = [[] for _ in self.shards]  # each shard's part starts, for bisecting
        self.first: list[int] = []  # index in self.filling of each shard's first part
        for index, item in enumerate(self.filling):
            if not self.starts[item.part.shard]:
                self.first.append(index)
            self.starts[item.part.shard].append(item.part.start)
        self.sources = _piece_sources(spec)
        self.records: list[tuple[int, PartRecord]] = []
        self.sending: set[asyncio.Task[None]] = set()
        self.failure: BaseException | None = None
        self.finished = False
        self._lock = threading.Lock()
        self._limit = asyncio.Semaphore(part_concurrency)
        largest = max((item.part.nbytes for item in self.filling), default=1)
        self.memory = max(memory, 2 * largest)
        """Bytes of part buffers past which a chunk's take waits for uploads to finish."""
        self.held = 0
        """Bytes of part buffers now (being filled, or waiting for or in their upload)."""
        self.high_water = 0
        self._freed = asyncio.Event()

    async def start(self) -> None:
        """Start the shards' uploads; parts that hold only header bytes go at once."""
        await self.uploads.start()
        self._send([item for item in self.filling if item.missing == 0])

    async def take(self, index: int, data: memoryview) -> None:
        """Chunk ``index`` of the save, whose bytes are ``data`` (its slab, still held:
        the copy finishes even when the caller is cancelled, before the slab goes back)."""
        self._raise_failure()
        if any(p.entry in self.places for p in self.spec.chunks[index].pieces):
            done = await complete_before_cancel(asyncio.to_thread(self._copy, index, data))
            self._send(done)
            await self._back_pressure()

    async def _back_pressure(self) -> None:
        """Wait while the part buffers exceed :attr:`memory` and uploads are under way
        (they free some): the save's upload, and through its RAM budget its capture, waits
        with it. With no upload under way the buffers are parts still being filled, which
        only later chunks complete: waiting would never end."""
        while self.held > self.memory and self.sending:
            self._freed.clear()
            await self._freed.wait()
            self._raise_failure()

    async def take_file(self, index: int, path: str) -> None:
        """Chunk ``index`` of the save, spooled in the file ``path``."""
        if not any(p.entry in self.places for p in self.spec.chunks[index].pieces):
            return

        def copy() -> list[_Filling]:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    return self._copy(index, view)
                finally:
                    view.release()

        self._raise_failure()
        self._send(await complete_before_cancel(asyncio.to_thread(copy)))
        await self._back_pressure()

    def _copy(self, index: int, data: memoryview) -> list[_Filling]:
        """Worker thread: copy chunk ``index``'s exported pieces into their parts; the parts
        this completed."""
        done = []
        chunk = self.spec.chunks[index]
        for piece, source in zip(chunk.pieces, self.sources[index], strict=True):
            place = self.places.get(piece.entry)
            if place is None:
                continue
            shard, offset = place
            at, end = offset + source, offset + source + piece.nbytes  # in the shard's file
            read = piece.dst_offset
            while at < end:
                k = bisect.bisect_right(self.starts[shard], at) - 1
                item = self.filling[self.first[shard] + k]
                take = min(end, item.part.end) - at
                buffer = self._buffer(item)
                buffer[at - item.part.start : at - item.part.start + take] = data[read : read + take]
                with self._lock:
                    item.missing -= take
                    if item.missing == 0:
                        done.append(item)
                at += take
                read += take
        return done

    def _send(self, items: list[_Filling]) -> None:
        for item in items:
            task = asyncio.get_running_loop().create_task(self._upload(item))
            self.sending.add(task)
            task.add_done_callback(self._sent)

    async def _upload(self, item: _Filling) -> None:
        async with self._limit:
            shard = self.shards[item.part.shard]
            buffer = memoryview(self._buffer(item))
            token = self.uploads.tokens[item.part.shard]
            assert token is not None
            name = self.uploads.name(shard.file)
            record = await self.uploads.storage.upload_part(name, token, item.part.number, item.part.start, buffer)
        self.records.append((item.part.shard, record))
        self._drop(item)

    def _buffer(self, item: _Filling) -> bytearray:
        """``item``'s buffer, made (and counted) at its first use (any thread)."""
        with self._lock:
            if item.buffer is None:
                self.held += item.part.nbytes
                self.high_water = max(self.high_water, self.held)
            return item.buffer_now()

    def _drop(self, item: _Filling) -> None:
        """Loop thread: ``item``'s buffer goes (uploaded, or the export stopped)."""
        with self._lock:
            if item.buffer is not None:
                item.buffer = None
                self.held -= item.part.nbytes
        self._freed.set()

    def _sent(self, task: asyncio.Task[None]) -> None:
        self.sending.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()
        self._freed.set()

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    async def finish(self) -> None:
        """Every chunk was taken: wait for the last parts, complete the shards, write the
        index (before the step's manifest)."""
        while self.sending:
            await asyncio.wait(set(self.sending))
        self._raise_failure()
        missing = [item.part for item in self.filling if item.missing]
        if missing:
            raise RuntimeError(f"step {self.spec.step}: the live export lacks bytes of {len(missing)} part(s)")
        await self.uploads.finish(self.records)
        self.finished = True

    async def abort(self) -> None:
        """The save failed (or was cancelled) before its commit: stop, abort the uploads."""
        if self.finished:
            return
        for task in list(self.sending):
            task.cancel()
        if self.sending:
            await asyncio.wait(set(self.sending))
        with contextlib.suppress(Exception):
            await self.uploads.abort()


def _piece_sources(spec: SaveSpec) -> list[list[int]]:
    """For each chunk, where each piece's bytes start in its entry (an entry's pieces
    continue its bytes in chunk order)."""
    seen: dict[int, int] = {}
    found = []
    for chunk in spec.chunks:
        starts = []
        for piece in chunk.pieces:
            starts.append(seen.get(piece.entry, 0))
            seen[piece.entry] = starts[-1] + piece.nbytes
        found.append(starts)
    return found
