"""The storage protocol (backends: :mod:`.local`, :mod:`.s3`; chosen by URL in :mod:`.registry`).

A backend is a small async interface over named objects (``/``-separated names relative
to the storage root). Every method runs on aiosnap's background loop thread. Conventions
every backend keeps:

- :meth:`Storage.write` is atomic: a reader sees the whole object or nothing.
- A missing object raises :class:`FileNotFoundError` (whatever the backend's own error).
- Other failures keep their original type (``OSError`` from a disk, for example), so they
  reach the user unchanged.
- When :meth:`Storage.write` or :meth:`Storage.read_into` returns or raises (cancellation
  included), no thread uses the buffer any more: the caller reuses it at once.
"""

from __future__ import annotations

import abc
import asyncio
import bisect
import contextlib
import contextvars
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..core.checksums import RangeChecksums, file_crc32c
from ..errors import ChecksumMismatchError

__all__ = [
    "PART_BYTES",
    "BytesLike",
    "ObjectInfo",
    "PartRecord",
    "ScatterTarget",
    "Storage",
    "check_spool_file",
    "in_control_lane",
    "preadv_all",
]

BytesLike = bytes | bytearray | memoryview
PartRecord = dict[str, Any]
"""What writing one part of an object in parts returned (JSON-able, so that the process that
completes the object can be another than the one that wrote the part)."""
PART_BYTES = 8 * 1024**2
"""Default part size of an object written in parts."""

_CONTROL_LANE: contextvars.ContextVar[bool] = contextvars.ContextVar("aiosnap_control_lane", default=False)


def in_control_lane() -> bool:
    """Whether the write running now is a :meth:`Storage.write_marker` (backends serve those
    apart from data writes: they must never queue behind them)."""
    return _CONTROL_LANE.get()


def _read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def check_spool_file(path: str, found: int, written: int, name: str) -> None:
    """Raise :class:`~aiosnap.errors.ChecksumMismatchError` unless ``found == written``."""
    if found != written:
        raise ChecksumMismatchError(
            f"spool file {path} is corrupt (crc32c {found:#010x}, written {written:#010x}); not committing {name}"
        )


class ScatterTarget:
    """Consecutive buffers seen as one destination of ``size`` bytes: :meth:`window` is the
    rest of the buffer holding byte ``position`` (what a stream reads into next)."""

    def __init__(self, buffers: Sequence[memoryview]) -> None:
        self.buffers = [memoryview(b).cast("B") for b in buffers]
        self.starts: list[int] = []
        position = 0
        for buffer in self.buffers:
            self.starts.append(position)
            position += len(buffer)
        self.size = position

    def window(self, position: int) -> memoryview:
        index = bisect.bisect_right(self.starts, position) - 1
        while len(self.buffers[index]) == 0 or position - self.starts[index] >= len(self.buffers[index]):
            index += 1  # past empty buffers
        return self.buffers[index][position - self.starts[index] :]


_IOV_MAX = 1024
_DELETES_AT_ONCE = 16


def preadv_all(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
    """Blocking: fill ``buffers`` in order from ``fd`` at ``offset`` with as few ``preadv``
    calls as the system allows; returns the bytes read (fewer at end of file)."""
    target = ScatterTarget(buffers)
    done = 0
    while done < target.size:
        first = target.window(done)
        batch = [first]
        index = bisect.bisect_right(target.starts, done)
        batch += [b for b in target.buffers[index : index + _IOV_MAX - 1] if len(b)]
        got = os.preadv(fd, batch, offset + done)
        if got == 0:
            break
        done += got
    return done


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: root-relative name, size in bytes, last modification (epoch s)."""

    name: str
    size: int
    mtime: float


class Storage(abc.ABC):
    """Async object storage rooted at one URL."""

    url: str
    settled_writes: bool = False
    """True when a :meth:`write` that returned, raised or was cancelled can have no effect
    later (local files: the rename happened or it did not). False for object stores, where
    a request abandoned mid-way may still land."""
    conditional_writes: bool = False
    """True when ``write(name, data, if_absent=True)`` lets exactly one of several writers of
    ``name`` win (local files: an atomic link; S3: ``If-None-Match`` with
    ``s3.conditional_commit``). A multi-rank save needs it: of its coordinator claiming the
    commit and another rank declaring the save aborted, exactly one must win."""
    read_only: bool = False
    """True when the root is only ever read (a translation of a foreign format such as a
    safetensors folder): saves to it are refused, so it needs no conditional writes."""
    single_file: bool = False
    """True when the root is one file holding one checkpoint that ``torch.load`` reads
    (:class:`~aiosnap.interop.singlefile.ArchiveStorage`): saves to it are planned as one file."""

    def attempt_started(self, spec: Any) -> None:  # noqa: B027 - optional hook
        """A save attempt, described by its :class:`~aiosnap.format.spec.SaveSpec` ``spec``,
        is about to write its objects here (loop thread; called once per attempt by the
        transfer side, before any write). (Typed ``Any``: storage sits below the format.)"""

    @abc.abstractmethod
    async def write(self, name: str, data: BytesLike, *, if_absent: bool = False) -> None:
        """Store ``data`` under ``name``, atomically and durably (replaces an old object).

        With ``if_absent``, raise :class:`FileExistsError` instead when ``name`` exists."""

    async def write_marker(self, name: str, data: BytesLike, *, if_absent: bool = False) -> None:
        """:meth:`write` of a small control object of a multi-rank save (a heartbeat, the
        verdict, a failure report), which must never wait behind data writes: a heartbeat
        queued behind a rank's uploads would make that live rank look stopped. Backends
        serve it in a lane of its own (:func:`in_control_lane` is true while it runs); this
        default is :meth:`write` in that lane."""
        token = _CONTROL_LANE.set(True)
        try:
            await self.write(name, data, if_absent=if_absent)
        finally:
            _CONTROL_LANE.reset(token)

    async def write_file(self, name: str, path: str, *, if_absent: bool = False) -> None:
        """Store the local file ``path`` under ``name`` (used for spooled chunks); with
        ``if_absent``, as :meth:`write`.

        This default reads the whole file into memory; the built-in backends stream it."""
        data = await asyncio.to_thread(_read_file, path)
        await self.write(name, data, if_absent=if_absent)

    async def write_checksummed(self, name: str, data: memoryview, checksums: RangeChecksums) -> None:
        """:meth:`write` of a staged buffer whose CRC32Cs are known (``checksums.of(start,
        end)``): backends that send checksums with the bytes use them rather than reading
        the bytes again. ``data`` may be referenced by the backend's connection beyond the
        return (see :class:`~aiosnap.core.arena.SlabLease`). This default is :meth:`write`."""
        await self.write(name, data)

    async def write_file_verified(self, name: str, path: str, crc: int) -> None:
        """:meth:`write_file`, but raise :class:`~aiosnap.errors.ChecksumMismatchError`
        (and make no object ``name``) unless the file's CRC32C is ``crc``. This default reads
        the file once to check it; backends that checksum what they send check that instead."""
        check_spool_file(path, await asyncio.to_thread(file_crc32c, path), crc, name)
        await self.write_file(name, path)

    @abc.abstractmethod
    async def read(self, name: str, *, limit: int | None = None) -> bytes:
        """The whole object (used for small objects such as manifests); with ``limit``, at
        most ``limit + 1`` bytes of it (so a caller can tell an object is too large without
        reading all of it)."""

    @abc.abstractmethod
    async def size(self, name: str) -> int:
        """The object's size in bytes (FileNotFoundError when it does not exist)."""

    @abc.abstractmethod
    async def read_into(self, name: str, offset: int, dest: memoryview) -> int:
        """Read up to ``len(dest)`` bytes from ``offset`` into ``dest``; returns bytes read
        (fewer only when the object ends early)."""

    async def read_scatter(self, name: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Read the consecutive bytes from ``offset`` into ``buffers``, filled in order (one
        request where the backend can: a coalesced read of many small ranges); returns the
        bytes read (fewer only when the object ends early). This default reads each buffer
        with :meth:`read_into`."""
        total = 0
        for buffer in buffers:
            got = await self.read_into(name, offset + total, buffer)
            total += got
            if got < len(buffer):
                break
        return total

    def reading(self) -> contextlib.AbstractAsyncContextManager[None]:
        """A context in which what is read comes from one version of the checkpoint, for
        backends where a writer can replace a whole checkpoint under a reader (one file:
        :class:`~aiosnap.interop.singlefile.ArchiveStorage`). This default does nothing."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    async def exists(self, name: str) -> bool:
        """True when the object exists."""

    @abc.abstractmethod
    async def list_children(self, prefix: str = "") -> list[str]:
        """Names of the immediate children (objects or folders) under ``prefix``."""

    @abc.abstractmethod
    async def delete(self, name: str) -> None:
        """Delete one object; a missing object is not an error."""

    @abc.abstractmethod
    async def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix``; a missing prefix is not an error."""

    async def delete_many(self, names: Sequence[str]) -> None:
        """Delete each of ``names`` (missing ones are not an error). This default deletes
        them one by one, a few at a time; backends with a batch delete use it."""
        limit = asyncio.Semaphore(_DELETES_AT_ONCE)

        async def one(name: str) -> None:
            async with limit:
                await self.delete(name)

        async with asyncio.TaskGroup() as group:
            for name in names:
                group.create_task(one(name))

    async def walk(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object under ``prefix`` (recursively), names relative to the root. Used by
        maintenance (``aiosnap ls --all``, ``aiosnap gc``) and the DCP writer's commit (which
        does without it), not by aiosnap's own saves or loads."""
        raise NotImplementedError(f"{type(self).__name__} cannot list objects with sizes and times")

    # -- an object written in parts (a safetensors shard: header first, bytes as they come) --

    def part_size_for(self, size: int) -> int:
        """The part size for writing a ``size``-byte object with :meth:`start_upload`: every
        part but the last has this size (S3: at least 5 MiB, at most 10,000 parts)."""
        return PART_BYTES

    async def start_upload(self, name: str) -> str:
        """Begin writing object ``name`` in parts, in any order, by any process of the job
        that holds the returned token (a JSON-able string); nothing is visible under
        ``name`` until :meth:`complete_upload`, and :meth:`abort_upload` removes every trace."""
        raise NotImplementedError(f"{type(self).__name__} cannot write objects in parts")

    async def upload_part(self, name: str, token: str, number: int, offset: int, data: memoryview) -> PartRecord:
        """Write part ``number`` (from 1), the bytes at ``offset`` of the object; every part
        but the last is :meth:`part_size_for` bytes. Returns what completing needs of it."""
        raise NotImplementedError(f"{type(self).__name__} cannot write objects in parts")

    async def complete_upload(self, name: str, token: str, parts: list[PartRecord]) -> None:
        """Make the object whole under ``name`` (replacing an old one), atomically: a reader
        sees the old object (or none) or the whole new one."""
        raise NotImplementedError(f"{type(self).__name__} cannot write objects in parts")

    async def stale_uploads(self, older_than: float) -> list[tuple[str, str]]:
        """Unfinished multipart uploads under the root started before ``older_than`` (epoch
        seconds), as (root-relative name, upload id). Backends without them have none."""
        return []

    async def abort_upload(self, name: str, upload_id: str) -> None:  # noqa: B027 - optional hook
        """Abort one unfinished multipart upload, or object written in parts (one already
        gone is not an error)."""

    async def translated_manifest(self, step: int) -> Any:
        """The manifest of ``step`` translated from a foreign checkpoint's own metadata
        (a read-only view of a DCP folder or a ``torch.save`` file:
        :class:`~aiosnap.interop.foreign.ForeignStorage`), or None for a root of aiosnap's
        own, whose ``manifest.json`` is read and validated as usual. (Typed ``Any``: storage
        sits below the format.)"""
        return None

    async def integrity_spans(self, step: int) -> list[Any]:
        """Byte ranges of ``step`` that :func:`~aiosnap.catalog.maintenance.verify_step`
        checks besides the manifest's, as ``(what, Span)`` pairs: of a DCP folder aiosnap's
        writer made, every whole item (its archive headers and pickle around the payload).
        None here. (Typed ``Any``: storage sits below the format.)"""
        return []

    async def connect(self) -> None:  # noqa: B027 - optional hook
        """Get ready to serve requests (make clients, load service models), called in the
        background when a checkpointer opens this root so that its first save does not pay
        for it. Failures are ignored here: the first request reports them."""

    async def check_root(self) -> None:  # noqa: B027 - optional hook
        """Raise FileNotFoundError / NotADirectoryError when the root cannot be a checkpoint
        root (a local path that does not exist, or is a file); used by maintenance, where a
        typo in a path must not look like an empty root."""

    async def remove_empty_folder(self, prefix: str = "") -> None:  # noqa: B027 - optional hook
        """Remove the folder ``prefix`` (the root itself when empty) if nothing is left in
        it, for backends that have folders."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and other resources."""
