"""One checkpoint as one local file that ``torch.load`` reads (:mod:`aiosnap.format.archive`).

:class:`ArchiveStorage` is a storage root that is a file path ``P``: it holds at most one
committed step, the one whose archive is at ``P``. It speaks the same object protocol as
every backend, so the commit protocol, loads and retention run unchanged:

- A save's data objects (its chunks) are byte ranges of the file. Each attempt writes them
  with ``pwrite`` at their offsets into its own *partial* file in ``P``'s folder, in any
  order, from several threads: an unnamed ``O_TMPFILE`` that listings of the folder never
  show and a crash never leaves behind, or where there is none (or the config has a spool,
  which may resume the save) the hidden ``.<name>.<step>.<save id>.aiosnap-partial`` (:mod:`.partialfile`).
- Writing the step's manifest is the commit: the tail (the pickle, the manifest, the zip
  central directory) is written, the partial file fsynced and linked or renamed to ``P``,
  the folder fsynced, under an ``flock`` of the folder: a reader sees the old file or the
  new one, never a part; a ``P`` holding a newer step is never replaced (StepOrderError),
  and with ``if_absent`` one that already holds the step is refused (FileExistsError).
- Reading a step's manifest or objects reads the archive at ``P`` whose trailer names that
  step (and the object's save id); a file at ``P`` that is not an aiosnap archive (an
  empty or placeholder file, a ``torch.save`` file) holds no step. Inside :meth:`ArchiveStorage.reading`
  every read comes from one version of the file, even while a writer replaces it.
- Deleting a step's manifest (or its attempt) unlinks ``P`` when ``P`` holds that step;
  partial files of the step (or attempt) are deleted with it.

The plan of a save to this storage must be laid out as one file (``single_file``): the
checkpointer does that for every storage whose :attr:`Storage.single_file` is true, and the
transfer side announces each save with :meth:`ArchiveStorage.attempt_started`.

Every coroutine runs on the loop thread of whoever owns the storage; file I/O runs on
worker threads (``asyncio.to_thread``), never cancelled halfway (a buffer handed to
``write`` is not used once it returns or raises).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import fcntl
import json
import os
import re
import stat as stat_module
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from ..config import Config
from ..core.aio import complete_before_cancel
from ..core.durable import fsync_dir
from ..core.names import MANIFEST_FILE, check_object_name, check_save_id, manifest_name, parse_step_dir, step_dir
from ..errors import CorruptCheckpointError, ManifestError, StepOrderError
from ..format.archive import (
    MARKS_BYTES,
    MAX_TRAILER_BYTES,
    Record,
    Trailer,
    build_tail,
    data_record_name,
    has_aiosnap_marks,
    parse_trailer,
)
from ..format.manifest import MAX_MANIFEST_BYTES, Manifest
from ..format.spec import SaveSpec
from ..storage.base import BytesLike, ObjectInfo, Storage, preadv_all
from ..storage.registry import storage_from_url
from .dcp.api import checkpoint_storage, is_dcp_checkpoint
from .partialfile import PartialFile, partial_name

__all__ = ["ArchiveStorage", "is_archive", "is_damaged_archive", "storage_for"]

_PARTIAL = re.compile(r"\.(?P<name>.+)\.(?P<step>[0-9]{12,20})\.(?P<save>[0-9a-f]{16})\.aiosnap-partial")
_COPY_BLOCK = 8 * 1024**2


@dataclass
class _Attempt:
    """One save in progress (loop thread creates; worker threads write its partial file)."""

    spec: SaveSpec
    partial: PartialFile
    offsets: dict[str, tuple[int, int]]  # object name -> (offset in the file, size)


class _Version:
    """One version of the file at ``P``, open (its fields guarded by the storage's lock)."""

    def __init__(self, fd: int, trailer: Trailer) -> None:
        self.fd = fd  # -1 once closed
        self.trailer = trailer
        self.objects: dict[str, tuple[int, int]] | None = None  # from its manifest, when read
        self.users = 0
        self.retired = False  # a newer version was seen: close when unused


_PINNED: contextvars.ContextVar[list[_Version] | None] = contextvars.ContextVar("aiosnap_archive_pins", default=None)
"""The versions a :meth:`ArchiveStorage.reading` context keeps open (worker threads started
inside the context see the same list)."""


class ArchiveStorage(Storage):
    """A checkpoint root that is one file (see the module docstring).

    ``resumable_partials``: partial files have names, so that what a save wrote outlives a
    crash and a spool resume can finish it (:meth:`for_config` sets it whenever the config
    has a spool: the trainer's saves and ``aiosnap resume``, which does not resume at start,
    must agree); otherwise they are unnamed where the platform allows. Either way, a named
    partial file of the same save already on disk (left by a crash) is the one written."""

    settled_writes = True
    single_file = True

    def __init__(self, path: str | os.PathLike[str], *, resumable_partials: bool = False) -> None:
        given = Path(path).expanduser().absolute()
        self.url = str(given)
        self.path = Path(os.path.realpath(given))  # a link at the path: its target is the checkpoint
        self.resumable_partials = resumable_partials
        self._fresh()

    @classmethod
    def for_config(cls, path: str | os.PathLike[str], config: Config | None, **kwargs: Any) -> Self:
        """The file ``path``, its partial files named whenever ``config`` has a spool (a save
        it journals may be finished by another process: the next trainer, ``aiosnap resume``),
        whether or not ``spool.resume`` finishes them at start. ``kwargs``: a subclass's own."""
        named = config is not None and config.spool.effective_mode != "off"
        return cls(path, resumable_partials=named, **kwargs)

    def _fresh(self) -> None:
        self._attempts: dict[str, _Attempt] = {}
        self._lock = threading.Lock()
        self._versions: dict[str, _Version] = {}  # save id -> open version (the current one, and pinned ones)

    def __getstate__(self) -> dict[str, Any]:
        """Its path only (the upload process makes its own attempts and opens its own files)."""
        return {"path": self.path, "url": self.url, "resumable_partials": self.resumable_partials}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh()

    # -- writing --------------------------------------------------------------------

    def attempt_started(self, spec: SaveSpec) -> None:
        """A save to this file starts: remember where its objects go (loop thread)."""
        if spec.archive is None:
            raise ValueError(f"{self.url}: a save to a single-file checkpoint must be planned as one file")
        offsets: dict[str, tuple[int, int]] = {}
        position = 0
        for chunk in spec.chunks:
            offsets[chunk.object_name] = (position, chunk.nbytes)
            position += chunk.nbytes
        if position != spec.archive.tail_offset:
            raise ValueError(f"{self.url}: the save's chunks end at {position}, not at {spec.archive.tail_offset}")
        name = partial_name(self.path, step_dir(spec.step), check_save_id(spec.save_id))
        partial = PartialFile(self.path, name, resumable=self.resumable_partials)
        self._attempts[spec.save_id] = _Attempt(spec, partial, offsets)

    def _attempt_of(self, name: str) -> _Attempt:
        parts = check_object_name(name).split("/")
        attempt = self._attempts.get(parts[1]) if len(parts) > 2 else None
        if attempt is None:
            raise FileNotFoundError(f"{self.url}: {name!r} is not part of a save in progress here")
        return attempt

    async def write(self, name: str, data: BytesLike, *, if_absent: bool = False) -> None:
        step = _manifest_step(name)
        if step is not None:
            await complete_before_cancel(asyncio.to_thread(self._commit, step, bytes(data), if_absent))
            return
        attempt = self._attempt_of(name)
        offset, nbytes = attempt.offsets.get(name, (0, -1))
        if nbytes != len(data):
            raise ValueError(f"{self.url}: object {name!r} is {len(data)} bytes, the plan says {nbytes}")
        await complete_before_cancel(asyncio.to_thread(self._pwrite, attempt, offset, data))

    async def write_file(self, name: str, path: str, *, if_absent: bool = False) -> None:
        # data objects only (a manifest comes through write): each has its own place in the file
        attempt = self._attempt_of(name)
        offset, nbytes = attempt.offsets.get(name, (0, -1))
        await complete_before_cancel(asyncio.to_thread(self._copy_in, attempt, offset, nbytes, path))

    def _pwrite(self, attempt: _Attempt, offset: int, data: BytesLike, *, sync: bool = True) -> None:
        fd = attempt.partial.fd()
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
        if sync:
            os.fdatasync(fd)  # landed means on disk (a resumed spool trusts what landed)

    def _copy_in(self, attempt: _Attempt, offset: int, nbytes: int, source: str) -> None:
        if os.path.getsize(source) != nbytes:
            raise ValueError(f"{self.url}: {source} is not the {nbytes} bytes the plan says")
        with open(source, "rb", buffering=0) as f:
            done = 0
            while done < nbytes:
                block = f.read(min(_COPY_BLOCK, nbytes - done))
                if not block:
                    raise OSError(f"{source} ended early")
                self._pwrite(attempt, offset + done, block, sync=done + len(block) == nbytes)
                done += len(block)

    def _commit(self, step: int, manifest_bytes: bytes, if_absent: bool) -> None:
        """Worker thread: finish the partial file and put it at ``P``."""
        named_step, save_id = _whose_manifest(manifest_bytes, self.url)
        attempt = self._attempts.get(save_id)
        if attempt is None or named_step != step:
            raise FileNotFoundError(f"{self.url}: no save in progress for step {step} (save {save_id})")
        spec = attempt.spec
        assert spec.archive is not None
        records = [
            Record(data_record_name(index), offset, entry.nbytes)
            for index, (offset, entry) in enumerate(zip(spec.archive.header_offsets, spec.entries, strict=True))
        ]
        tail = build_tail(
            spec.archive.tail_offset, records, base64.b64decode(spec.archive.pickle), manifest_bytes,
            step=step, save_id=spec.save_id,
        )  # fmt: skip
        fd = attempt.partial.fd()
        self._pwrite(attempt, spec.archive.tail_offset, tail)
        os.ftruncate(fd, spec.archive.tail_offset + len(tail))
        os.fsync(fd)
        with self._folder_lock():  # another process's commit or removal waits
            held = self._held_trailer()
            if held is not None and held.step > step:
                raise StepOrderError(
                    f"{self.url}: holds step {held.step}, newer than step {step}, committed while this save "
                    "ran: not replacing it"
                )
            if if_absent and held is not None and held.step == step:
                raise FileExistsError(f"{self.url}: step {step} is there already")
            attempt.partial.publish()
            fsync_dir(self.path.parent)
        self._attempts.pop(spec.save_id, None)
        self._retire_all()

    @contextlib.contextmanager
    def _folder_lock(self) -> Iterator[None]:
        """Blocking: an exclusive ``flock`` on ``P``'s folder, so that the check of what ``P``
        holds and the rename or unlink that depends on it are one step for every process."""
        fd = os.open(self.path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    # -- reading --------------------------------------------------------------------

    def _use_current(self) -> _Version | None:
        """Worker thread: the version of the file at ``P`` now, open and in use by the caller
        (who releases it), or None when ``P`` is not an aiosnap archive. Older versions are
        closed once nobody reads them. Inside :meth:`reading`, the first version seen is the
        one every later call gets (a snapshot), kept open until the context ends."""
        pins = _PINNED.get()
        if pins:
            with self._lock:
                self._use(pins[0])
            return pins[0]
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        try:
            stat = os.fstat(fd)
            trailer = None
            if stat_module.S_ISREG(stat.st_mode):
                size = stat.st_size
                tail = os.pread(fd, min(size, MAX_TRAILER_BYTES), max(0, size - MAX_TRAILER_BYTES))
                trailer = parse_trailer(tail, size)
        except BaseException:
            os.close(fd)
            raise
        if trailer is None:
            os.close(fd)
            return None
        with self._lock:
            version = self._versions.get(trailer.save_id)
            if version is None or version.retired:
                version = self._versions[trailer.save_id] = _Version(fd, trailer)
            else:
                os.close(fd)  # the same save: the same bytes
            for other in list(self._versions.values()):
                if other is not version:
                    self._retire(other)
            self._use(version)
        return version

    def _use_saved(self, name: str) -> _Version:
        """Worker thread: the version that holds object ``name`` (its save id is in the name),
        in use by the caller: one read earlier in a :meth:`reading` context, or the file at
        ``P`` now. FileNotFoundError when neither holds it."""
        parts = check_object_name(name).split("/")
        save_id = parts[1] if len(parts) > 2 else ""
        with self._lock:
            version = self._versions.get(save_id)
            if version is not None and version.fd >= 0:
                self._use(version)
                return version
        version = self._use_current()
        if version is None:
            raise FileNotFoundError(f"{self.url}: not an aiosnap checkpoint (yet)")
        if version.trailer.save_id != save_id:
            self._release(version)
            raise FileNotFoundError(f"{self.url}: no object {name!r} in the checkpoint there now")
        return version

    def _use(self, version: _Version) -> None:
        """With the lock held: one more user (two inside a reading context: it keeps one)."""
        version.users += 1
        pins = _PINNED.get()
        if pins is not None and version not in pins:
            version.users += 1
            pins.append(version)

    def _release(self, version: _Version) -> None:
        with self._lock:
            version.users -= 1
            if version.retired and version.users == 0:
                self._close_version(version)

    def _retire(self, version: _Version) -> None:
        """With the lock held: close ``version`` once nobody reads it."""
        version.retired = True
        if version.users == 0:
            self._close_version(version)

    def _close_version(self, version: _Version) -> None:
        if version.fd >= 0:
            os.close(version.fd)
            version.fd = -1
        if self._versions.get(version.trailer.save_id) is version:
            del self._versions[version.trailer.save_id]

    def _retire_all(self) -> None:
        with self._lock:
            for version in list(self._versions.values()):
                self._retire(version)

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        """Everything read inside comes from the version of the file first seen inside (a
        snapshot), even when a writer replaces the file meanwhile: a load finds its step,
        reads its manifest and its data from one version."""
        pins: list[_Version] = []
        token = _PINNED.set(pins)
        try:
            yield
        finally:
            _PINNED.reset(token)
            for version in pins:
                self._release(version)

    def _held_trailer(self) -> Trailer | None:
        """Worker thread: the trailer of the archive at ``P`` now (None: not an archive)."""
        version = self._use_current()
        if version is None:
            return None
        self._release(version)
        return version.trailer

    def _manifest_bytes(self, version: _Version) -> bytes:
        trailer = version.trailer
        if trailer.manifest_nbytes > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{self.url}: {trailer.manifest_nbytes} bytes is too large for a manifest")
        return os.pread(version.fd, trailer.manifest_nbytes, trailer.manifest_offset)

    def _objects(self, version: _Version) -> dict[str, tuple[int, int]]:
        """The version's objects (offset in the file, size), from its manifest's object table.
        A load has the whole manifest checked by the catalog already (the same version: see
        :meth:`reading`); here only the table is taken, its types checked, and a table that
        is not well-formed has the whole manifest checked (which raises ManifestError)."""
        if version.objects is None:
            data = self._manifest_bytes(version)
            table = _object_table(data)
            if table is None:
                table = [(o.name, o.nbytes) for o in Manifest.from_json(data, self.url).objects]
            objects: dict[str, tuple[int, int]] = {}
            position = 0
            for name, nbytes in table:
                objects[name] = (position, nbytes)
                position += nbytes
            version.objects = objects
        return version.objects

    def _object(self, version: _Version, name: str) -> tuple[int, int]:
        found = self._objects(version).get(name)
        if found is None:
            raise FileNotFoundError(f"{self.url}: no object {name!r} in the checkpoint")
        return found

    def _read_sync(self, name: str, limit: int | None) -> bytes:
        step = _manifest_step(name)
        if step is None:
            version = self._use_saved(name)
        else:
            found = self._use_current()
            if found is None:
                raise FileNotFoundError(f"{self.url}: not an aiosnap checkpoint (yet)")
            version = found
        try:
            if step is not None:
                if version.trailer.step != step:
                    raise FileNotFoundError(f"{self.url}: holds step {version.trailer.step}, not {step}")
                data = self._manifest_bytes(version)
            else:
                offset, nbytes = self._object(version, name)
                data = os.pread(version.fd, nbytes, offset)
            return data if limit is None else data[: limit + 1]
        finally:
            self._release(version)

    async def read(self, name: str, *, limit: int | None = None) -> bytes:
        return await asyncio.to_thread(self._read_sync, name, limit)

    async def size(self, name: str) -> int:
        def size_sync() -> int:
            attempt = self._attempts.get(name.split("/")[1] if name.count("/") >= 2 else "")
            if attempt is not None:  # a save in progress (resumed): what landed in its partial file
                offset, nbytes = attempt.offsets.get(name, (0, -1))
                landed = attempt.partial.landed_size()
                if nbytes < 0 or landed is None or landed < offset + nbytes:
                    raise FileNotFoundError(f"{self.url}: {name!r} has not landed")
                return nbytes
            version = self._use_saved(name)
            try:
                return self._object(version, name)[1]
            finally:
                self._release(version)

        return await asyncio.to_thread(size_sync)

    async def read_into(self, name: str, offset: int, dest: memoryview) -> int:
        return await self.read_scatter(name, offset, [dest])

    async def read_scatter(self, name: str, offset: int, buffers: Sequence[memoryview]) -> int:
        def read_sync() -> int:
            version = self._use_saved(name)
            try:
                start, nbytes = self._object(version, name)
                room = max(0, nbytes - offset)
                fitting: list[memoryview] = []
                for buffer in buffers:  # never past the object's end into the next one
                    view = memoryview(buffer).cast("B")[:room]
                    fitting.append(view)
                    room -= len(view)
                return preadv_all(version.fd, fitting, start + offset)
            finally:
                self._release(version)

        return await complete_before_cancel(asyncio.to_thread(read_sync))

    async def exists(self, name: str) -> bool:
        step = _manifest_step(name)
        if step is not None:
            held = await asyncio.to_thread(self._held_trailer)
            return held is not None and held.step == step
        try:
            await self.size(name)
        except FileNotFoundError:
            return False
        return True

    def _partials(self) -> list[tuple[int, str, Path]]:
        """Worker thread: (step, save id, path) of the named partial files of ``P`` (of any
        process; unnamed ones are not listed anywhere)."""
        found = []
        with suppress(FileNotFoundError, NotADirectoryError):
            for entry in os.scandir(self.path.parent):
                match = _PARTIAL.fullmatch(entry.name)
                if match and match["name"] == self.path.name:
                    step = parse_step_dir(match["step"])
                    if step is not None:
                        found.append((step, match["save"], Path(entry.path)))
        return found

    async def list_children(self, prefix: str = "") -> list[str]:
        def list_sync() -> list[str]:
            held = self._held_trailer()
            wanted = prefix.strip("/")
            if wanted == "":
                steps = {step for step, _, _ in self._partials()}
                if held is not None:
                    steps.add(held.step)
                return sorted(step_dir(s) for s in steps)
            step = parse_step_dir(wanted)
            if step is None:
                return []
            names = {save for s, save, _ in self._partials() if s == step}
            if held is not None and held.step == step:
                names |= {MANIFEST_FILE, held.save_id}
            return sorted(names)

        return await asyncio.to_thread(list_sync)

    async def walk(self, prefix: str = "") -> list[ObjectInfo]:
        """The committed step's manifest and objects, and each partial file (as the object
        ``<step>/<save id>/partial``: what ``aiosnap gc`` removes once it is old)."""

        def walk_sync() -> list[ObjectInfo]:
            found = []
            for step, save_id, path in self._partials():
                with suppress(FileNotFoundError):
                    stat = path.stat()
                    found.append(ObjectInfo(f"{step_dir(step)}/{save_id}/partial", stat.st_size, stat.st_mtime))
            version = self._use_current()
            if version is not None:
                try:
                    mtime = os.fstat(version.fd).st_mtime
                    trailer = version.trailer
                    found.append(ObjectInfo(manifest_name(trailer.step), trailer.manifest_nbytes, mtime))
                    with suppress(CorruptCheckpointError):
                        found += [ObjectInfo(name, size, mtime) for name, (_, size) in self._objects(version).items()]
                finally:
                    self._release(version)
            return sorted((o for o in found if o.name.startswith(prefix)), key=lambda o: o.name)

        return await asyncio.to_thread(walk_sync)

    # -- removing -------------------------------------------------------------------

    async def delete(self, name: str) -> None:
        step = _manifest_step(name)
        if step is not None:
            await asyncio.to_thread(self._remove, step, None, partials=False)
        # a data object is a byte range of the file: it goes with its step

    async def delete_prefix(self, prefix: str) -> None:
        parts = prefix.strip("/").split("/")
        step = parse_step_dir(parts[0])
        if step is None:
            if parts[0] == "":
                raise ValueError("refusing to delete the whole storage root")
            return  # nothing aiosnap writes is named like that
        save_id = parts[1] if len(parts) > 1 else None
        await asyncio.to_thread(self._remove, step, save_id, partials=True)

    def _remove(self, step: int, save_id: str | None, *, partials: bool) -> None:
        """Worker thread: unlink ``P`` if it holds ``step`` (of ``save_id``, when given), and
        with ``partials`` the partial files of that step (or attempt)."""
        with self._folder_lock():
            held = self._held_trailer()
            if held is not None and held.step == step and save_id in (None, held.save_id):
                with suppress(FileNotFoundError):
                    self.path.unlink()
        self._retire_all()
        if partials:
            for found_save, attempt in list(self._attempts.items()):
                if attempt.spec.step == step and save_id in (None, found_save):
                    self._attempts.pop(found_save, None)
                    attempt.partial.discard()
            for found_step, found_save, path in self._partials():  # other processes', and crashes'
                if found_step == step and save_id in (None, found_save):
                    with suppress(FileNotFoundError):
                        path.unlink()
        with suppress(OSError):
            fsync_dir(self.path.parent)

    async def check_root(self) -> None:
        if not self.path.exists():
            raise FileNotFoundError(f"{self.url}: no such checkpoint file")
        if self.path.is_dir():
            raise IsADirectoryError(f"{self.url}: is a folder, not a single-file checkpoint")

    async def close(self) -> None:
        self._retire_all()
        for attempt in list(self._attempts.values()):
            attempt.partial.close()  # an unnamed one is gone with it; a named one stays for gc or a resume
        self._attempts.clear()


def is_archive(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a file aiosnap committed as a single-file checkpoint (blocks:
    one small read of its end)."""
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            tail = os.pread(f.fileno(), min(size, MAX_TRAILER_BYTES), max(0, size - MAX_TRAILER_BYTES))
    except OSError:
        return False
    return parse_trailer(tail, size) is not None


def is_damaged_archive(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a file aiosnap wrote as a single-file checkpoint whose end is
    damaged: no :func:`is_archive`, yet aiosnap's marks (blocks: one small read of its end).
    Such a file is never to be read unverified with ``torch.load``."""
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            tail = os.pread(f.fileno(), min(size, MARKS_BYTES), max(0, size - MARKS_BYTES))
    except OSError:
        return False
    return parse_trailer(tail[-MAX_TRAILER_BYTES:], size) is None and has_aiosnap_marks(tail)


_MANIFEST_HEAD = re.compile(rb'\{"format":"aiosnap","format_version":\d+,"step":(\d+),"save_id":"([0-9a-f]{16})"')


def _object_table(data: bytes) -> list[tuple[str, int]] | None:
    """``objects`` of a manifest as (name, size) pairs, or None when it is not well-formed."""
    try:
        table = [(o["name"], o["nbytes"]) for o in json.loads(data)["objects"]]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    if all(type(name) is str and type(nbytes) is int and 0 <= nbytes < 2**63 for name, nbytes in table):
        return table
    return None


def _whose_manifest(data: bytes, where: str) -> tuple[int, str]:
    """The step and save id of a manifest being committed: read from its first bytes, as
    :meth:`Manifest.to_json` writes them (a 40,000-entry manifest takes a second to parse,
    and the commit has just built it); anything else is parsed and checked whole."""
    head = _MANIFEST_HEAD.match(data)
    if head is not None:
        return int(head[1]), head[2].decode("ascii")
    manifest = Manifest.from_json(data, f"{where} (manifest being committed)")
    return manifest.step, manifest.save_id


def _manifest_step(name: str) -> int | None:
    """The step whose manifest ``name`` is, or None for any other name."""
    folder, _, leaf = name.partition("/")
    return parse_step_dir(folder) if leaf == MANIFEST_FILE else None


def storage_for(url: str, config: Config | None = None) -> Storage:
    """The backend for a checkpoint location: a local path that is a file is a single-file
    checkpoint (a Lightning checkpoint saved through aiosnap, say); a local folder holding a
    DCP checkpoint (its ``.metadata``) is that checkpoint, read-only (see
    :func:`aiosnap.interop.dcp.api.checkpoint_storage`); anything else is the root
    :func:`~aiosnap.storage.registry.storage_from_url` makes."""
    if "://" not in url and os.path.isfile(os.path.expanduser(url)):
        return ArchiveStorage.for_config(url, config)
    if "://" not in url and is_dcp_checkpoint(url):
        return checkpoint_storage(url, config)
    return storage_from_url(url, config)
