"""One checkpoint as one local file that ``torch.load`` reads (:mod:`aiosnap.format.archive`).

:class:`ArchiveStorage` is a storage root that is a file path ``P``: it holds at most one
committed step, the one whose archive is at ``P``. It speaks the same object protocol as
every backend, so the commit protocol, loads and retention run unchanged:

- A save's data objects (its chunks) are byte ranges of the file. Each attempt writes them
  with ``pwrite`` at their offsets into its own *partial* file beside ``P``
  (``.<name>.<step>.<save id>.aiosnap-partial``), in any order, from several threads.
- Writing the step's manifest is the commit: the tail (the pickle, the manifest, the zip
  central directory) is written, the partial file fsynced and renamed over ``P``, the
  folder fsynced. A reader sees the old file or the new one, never a part. With
  ``if_absent``, a ``P`` that already holds the step is refused (FileExistsError).
- Reading a step's manifest or objects reads the archive at ``P`` whose trailer names that
  step (and the object's save id); a file at ``P`` that is not an aiosnap archive (an
  empty placeholder, a ``torch.save`` file) holds no step.
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
import os
import re
import stat as stat_module
import threading
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..aio import complete_before_cancel
from ..durable import fsync_dir, publish_if_absent
from ..errors import CorruptCheckpointError, ManifestError
from ..format.archive import MAX_TRAILER_BYTES, Record, Trailer, build_tail, data_record_name, parse_trailer
from ..format.manifest import MAX_MANIFEST_BYTES, Manifest
from ..format.spec import SaveSpec
from ..names import MANIFEST_FILE, check_object_name, check_save_id, manifest_name, parse_step_dir, step_dir
from .base import BytesLike, ObjectInfo, Storage, preadv_all

__all__ = ["ArchiveStorage", "is_archive"]

_PARTIAL = re.compile(r"\.(?P<name>.+)\.(?P<step>[0-9]{12,20})\.(?P<save>[0-9a-f]{16})\.aiosnap-partial")
_COPY_BLOCK = 8 * 1024**2


@dataclass
class _Attempt:
    """One save's partial file (loop thread creates; worker threads write)."""

    spec: SaveSpec
    path: Path
    offsets: dict[str, tuple[int, int]]  # object name -> (offset in the file, size)
    fd: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class _Committed:
    """The archive at ``P`` as one version of the file saw it."""

    trailer: Trailer
    objects: dict[str, tuple[int, int]]  # from its manifest; empty until it was read


class ArchiveStorage(Storage):
    """A checkpoint root that is one file (see the module docstring)."""

    settled_writes = True
    single_file = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser().absolute()
        self.url = str(self.path)
        self._fresh()

    def _fresh(self) -> None:
        self._attempts: dict[str, _Attempt] = {}
        self._versions: dict[tuple[int, int, int, int], _Committed] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Its path only (the upload process makes its own attempts)."""
        return {"path": self.path, "url": self.url}

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
        self._attempts[spec.save_id] = _Attempt(spec, self._partial(spec.step, spec.save_id), offsets)

    def _partial(self, step: int, save_id: str) -> Path:
        return self.path.with_name(f".{self.path.name}.{step_dir(step)}.{check_save_id(save_id)}.aiosnap-partial")

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

    async def write_file(self, name: str, path: str) -> None:
        attempt = self._attempt_of(name)
        offset, nbytes = attempt.offsets.get(name, (0, -1))
        await complete_before_cancel(asyncio.to_thread(self._copy_in, attempt, offset, nbytes, path))

    @staticmethod
    def _open(attempt: _Attempt) -> int:
        with attempt.lock:
            if attempt.fd is None:
                attempt.fd = os.open(attempt.path, os.O_CREAT | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o644)
            return attempt.fd

    def _pwrite(self, attempt: _Attempt, offset: int, data: BytesLike) -> None:
        fd = self._open(attempt)
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
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
                self._pwrite(attempt, offset + done, block)
                done += len(block)

    def _commit(self, step: int, manifest_bytes: bytes, if_absent: bool) -> None:
        """Worker thread: finish the partial file and put it at ``P``."""
        manifest = Manifest.from_json(manifest_bytes, f"{self.url} (manifest being committed)")
        attempt = self._attempts.get(manifest.save_id)
        if attempt is None or manifest.step != step:
            raise FileNotFoundError(f"{self.url}: no save in progress for step {step} (save {manifest.save_id})")
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
        fd = self._open(attempt)
        self._pwrite(attempt, spec.archive.tail_offset, tail)
        os.ftruncate(fd, spec.archive.tail_offset + len(tail))
        os.fsync(fd)
        with attempt.lock:
            os.close(fd)
            attempt.fd = None
        if not self.path.exists():
            publish_if_absent(attempt.path, self.path)
        else:
            held = self._trailer()
            if if_absent and held is not None and held.step == step:
                raise FileExistsError(f"{self.url}: step {step} is there already")
            os.replace(attempt.path, self.path)
        fsync_dir(self.path.parent)
        self._attempts.pop(spec.save_id, None)

    # -- reading --------------------------------------------------------------------

    def _trailer(self) -> Trailer | None:
        """Worker thread: the trailer of the file at ``P`` now (None: not an archive)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        try:
            return self._version(fd).trailer
        except (FileNotFoundError, _NotAnArchive):
            return None
        finally:
            os.close(fd)

    def _version(self, fd: int, *, with_objects: bool = False) -> _Committed:
        """The archive open as ``fd`` (cached per version of the file); with
        ``with_objects``, its manifest read and checked too."""
        stat = os.fstat(fd)
        key = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        found = self._versions.get(key)
        if found is None:
            if not stat_module.S_ISREG(stat.st_mode):
                raise _NotAnArchive()
            size = stat.st_size
            tail = os.pread(fd, min(size, MAX_TRAILER_BYTES), max(0, size - MAX_TRAILER_BYTES))
            trailer = parse_trailer(tail, size)
            if trailer is None:
                raise _NotAnArchive()
            found = _Committed(trailer, {})
        if with_objects and not found.objects:
            found = _Committed(found.trailer, self._objects_of(fd, found.trailer))
        if len(self._versions) > 8:
            self._versions.clear()
        self._versions[key] = found
        return found

    def _manifest_bytes(self, fd: int, trailer: Trailer) -> bytes:
        if trailer.manifest_nbytes > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{self.url}: {trailer.manifest_nbytes} bytes is too large for a manifest")
        return os.pread(fd, trailer.manifest_nbytes, trailer.manifest_offset)

    def _objects_of(self, fd: int, trailer: Trailer) -> dict[str, tuple[int, int]]:
        manifest = Manifest.from_json(self._manifest_bytes(fd, trailer), self.url)
        objects: dict[str, tuple[int, int]] = {}
        position = 0
        for obj in manifest.objects:
            objects[obj.name] = (position, obj.nbytes)
            position += obj.nbytes
        return objects

    def _read_sync(self, step: int | None, name: str, limit: int | None) -> bytes:
        fd = self._open_committed()
        try:
            version = self._version(fd, with_objects=step is None)
            if step is not None:
                if version.trailer.step != step:
                    raise FileNotFoundError(f"{self.url}: holds step {version.trailer.step}, not {step}")
                data = self._manifest_bytes(fd, version.trailer)
            else:
                offset, nbytes = self._object(version, name)
                data = os.pread(fd, nbytes, offset)
            return data if limit is None else data[: limit + 1]
        finally:
            os.close(fd)

    def _open_committed(self) -> int:
        try:
            return os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except (IsADirectoryError, NotADirectoryError) as exc:
            raise FileNotFoundError(f"{self.url}: not a file") from exc

    def _object(self, version: _Committed, name: str) -> tuple[int, int]:
        parts = check_object_name(name).split("/")
        found = version.objects.get(name)
        if found is None or len(parts) < 2 or parts[1] != version.trailer.save_id:
            raise FileNotFoundError(f"{self.url}: no object {name!r} in the checkpoint there now")
        return found

    async def read(self, name: str, *, limit: int | None = None) -> bytes:
        try:
            return await asyncio.to_thread(self._read_sync, _manifest_step(name), name, limit)
        except _NotAnArchive:
            raise FileNotFoundError(f"{self.url}: not an aiosnap checkpoint (yet)") from None

    async def size(self, name: str) -> int:
        def size_sync() -> int:
            attempt = self._attempts.get(name.split("/")[1] if name.count("/") >= 2 else "")
            if attempt is not None:  # a save in progress (resumed): what landed in its partial file
                offset, nbytes = attempt.offsets.get(name, (0, -1))
                if nbytes < 0 or not attempt.path.exists() or attempt.path.stat().st_size < offset + nbytes:
                    raise FileNotFoundError(f"{self.url}: {name!r} has not landed")
                return nbytes
            fd = self._open_committed()
            try:
                return self._object(self._version(fd, with_objects=True), name)[1]
            finally:
                os.close(fd)

        try:
            return await asyncio.to_thread(size_sync)
        except _NotAnArchive:
            raise FileNotFoundError(f"{self.url}: not an aiosnap checkpoint (yet)") from None

    async def read_into(self, name: str, offset: int, dest: memoryview) -> int:
        return await self.read_scatter(name, offset, [dest])

    async def read_scatter(self, name: str, offset: int, buffers: Sequence[memoryview]) -> int:
        def read_sync() -> int:
            fd = self._open_committed()
            try:
                start, nbytes = self._object(self._version(fd, with_objects=True), name)
                room = max(0, nbytes - offset)
                fitting: list[memoryview] = []
                for buffer in buffers:  # never past the object's end into the next one
                    view = memoryview(buffer).cast("B")[:room]
                    fitting.append(view)
                    room -= len(view)
                return preadv_all(fd, fitting, start + offset)
            finally:
                os.close(fd)

        try:
            return await complete_before_cancel(asyncio.to_thread(read_sync))
        except _NotAnArchive:
            raise FileNotFoundError(f"{self.url}: not an aiosnap checkpoint (yet)") from None

    async def exists(self, name: str) -> bool:
        step = _manifest_step(name)
        if step is not None:
            held = await asyncio.to_thread(self._trailer)
            return held is not None and held.step == step
        try:
            await self.size(name)
        except FileNotFoundError:
            return False
        return True

    def _partials(self) -> list[tuple[int, str, Path]]:
        """Worker thread: (step, save id, path) of the partial files of ``P``."""
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
            held = self._trailer()
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
            with suppress(FileNotFoundError, _NotAnArchive, CorruptCheckpointError):
                fd = self._open_committed()
                try:
                    mtime = os.fstat(fd).st_mtime
                    version = self._version(fd)
                    step = version.trailer.step
                    found.append(ObjectInfo(manifest_name(step), version.trailer.manifest_nbytes, mtime))
                    version = self._version(fd, with_objects=True)
                    found += [ObjectInfo(name, size, mtime) for name, (_, size) in version.objects.items()]
                finally:
                    os.close(fd)
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
        held = self._trailer()
        if held is not None and held.step == step and save_id in (None, held.save_id):
            with suppress(FileNotFoundError):
                self.path.unlink()
        if partials:
            for found_step, found_save, path in self._partials():
                if found_step == step and save_id in (None, found_save):
                    attempt = self._attempts.pop(found_save, None)
                    if attempt is not None:
                        with attempt.lock:
                            if attempt.fd is not None:
                                os.close(attempt.fd)
                                attempt.fd = None
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
        for attempt in list(self._attempts.values()):
            with attempt.lock:
                if attempt.fd is not None:
                    os.close(attempt.fd)
                    attempt.fd = None
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


class _NotAnArchive(Exception):
    """The file at ``P`` is not an aiosnap archive."""


def _manifest_step(name: str) -> int | None:
    """The step whose manifest ``name`` is, or None for any other name."""
    folder, _, leaf = name.partition("/")
    return parse_step_dir(folder) if leaf == MANIFEST_FILE else None
