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

The storage composes three parts: the saves in progress and their partial files
(:class:`~.archivewriter.ArchiveWriter`), the commit and removal of the file at ``P``
(:class:`~.archivecommit.ArchiveCommit`), and the open versions of that file that reads
come from (:class:`~.archiveversions.ArchiveVersions`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any, Self

from ..config import Config
from ..core.aio import complete_before_cancel
from ..core.durable import fsync_dir
from ..core.names import MANIFEST_FILE, manifest_name, parse_step_dir, step_dir
from ..errors import ConfigError, CorruptCheckpointError
from ..format.archive import MARKS_BYTES, MAX_TRAILER_BYTES, has_aiosnap_marks, parse_trailer
from ..format.spec import SaveSpec
from ..storage.base import BytesLike, ObjectInfo, Storage, preadv_all
from ..storage.registry import storage_from_url
from .archivecommit import ArchiveCommit
from .archiveversions import ArchiveVersions
from .archivewriter import ArchiveWriter
from .dcp.api import checkpoint_storage, is_dcp_checkpoint
from .partialfile import named_partials

__all__ = ["ArchiveStorage", "is_archive", "is_damaged_archive", "storage_for"]


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
        self._writer = ArchiveWriter(self.url, self.path, self.resumable_partials)
        self._versions = ArchiveVersions(self.url, self.path)
        self._committer = ArchiveCommit(self.url, self.path, self._writer, self._versions)

    def __getstate__(self) -> dict[str, Any]:
        """Its path only (the upload process makes its own attempts and opens its own files)."""
        return {"path": self.path, "url": self.url, "resumable_partials": self.resumable_partials}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh()

    # -- writing --------------------------------------------------------------------

    def attempt_started(self, spec: SaveSpec) -> None:
        """A save to this file starts: remember where its objects go (loop thread)."""
        self._writer.started(spec)

    async def write(self, name: str, data: BytesLike, *, if_absent: bool = False) -> None:
        step = _manifest_step(name)
        if step is not None:
            await complete_before_cancel(asyncio.to_thread(self._committer.commit, step, bytes(data), if_absent))
            return
        attempt = self._writer.attempt_of(name)
        offset, nbytes = attempt.offsets.get(name, (0, -1))
        if nbytes != len(data):
            raise ValueError(f"{self.url}: object {name!r} is {len(data)} bytes, the plan says {nbytes}")
        await complete_before_cancel(asyncio.to_thread(self._writer.pwrite, attempt, offset, data))

    async def write_file(self, name: str, path: str, *, if_absent: bool = False) -> None:
        # data objects only (a manifest comes through write): each has its own place in the file
        attempt = self._writer.attempt_of(name)
        offset, nbytes = attempt.offsets.get(name, (0, -1))
        await complete_before_cancel(asyncio.to_thread(self._writer.copy_in, attempt, offset, nbytes, path))

    # -- reading --------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        """Everything read inside comes from the version of the file first seen inside (a
        snapshot), even when a writer replaces the file meanwhile: a load finds its step,
        reads its manifest and its data from one version."""
        async with self._versions.reading():
            yield

    def _read_sync(self, name: str, limit: int | None) -> bytes:
        versions = self._versions
        step = _manifest_step(name)
        if step is None:
            version = versions.use_saved(name)
        else:
            found = versions.use_current()
            if found is None:
                raise FileNotFoundError(f"{self.url}: not an aiosnap checkpoint (yet)")
            version = found
        try:
            if step is not None:
                if version.trailer.step != step:
                    raise FileNotFoundError(f"{self.url}: holds step {version.trailer.step}, not {step}")
                data = versions.manifest_bytes(version)
            else:
                offset, nbytes = versions.object_of(version, name)
                data = os.pread(version.fd, nbytes, offset)
            return data if limit is None else data[: limit + 1]
        finally:
            versions.release(version)

    async def read(self, name: str, *, limit: int | None = None) -> bytes:
        return await asyncio.to_thread(self._read_sync, name, limit)

    async def size(self, name: str) -> int:
        def size_sync() -> int:
            landed = self._writer.landed(name)
            if landed is not None:  # a save in progress (resumed): what landed in its partial file
                return landed
            version = self._versions.use_saved(name)
            try:
                return self._versions.object_of(version, name)[1]
            finally:
                self._versions.release(version)

        return await asyncio.to_thread(size_sync)

    async def read_into(self, name: str, offset: int, dest: memoryview) -> int:
        return await self.read_scatter(name, offset, [dest])

    async def read_scatter(self, name: str, offset: int, buffers: Sequence[memoryview]) -> int:
        def read_sync() -> int:
            version = self._versions.use_saved(name)
            try:
                start, nbytes = self._versions.object_of(version, name)
                room = max(0, nbytes - offset)
                fitting: list[memoryview] = []
                for buffer in buffers:  # never past the object's end into the next one
                    view = memoryview(buffer).cast("B")[:room]
                    fitting.append(view)
                    room -= len(view)
                return preadv_all(version.fd, fitting, start + offset)
            finally:
                self._versions.release(version)

        return await complete_before_cancel(asyncio.to_thread(read_sync))

    async def exists(self, name: str) -> bool:
        step = _manifest_step(name)
        if step is not None:
            held = await asyncio.to_thread(self._versions.held_trailer)
            return held is not None and held.step == step
        try:
            await self.size(name)
        except FileNotFoundError:
            return False
        return True

    async def list_children(self, prefix: str = "") -> list[str]:
        def list_sync() -> list[str]:
            held = self._versions.held_trailer()
            wanted = prefix.strip("/")
            if wanted == "":
                steps = {step for step, _, _ in named_partials(self.path)}
                if held is not None:
                    steps.add(held.step)
                return sorted(step_dir(s) for s in steps)
            step = parse_step_dir(wanted)
            if step is None:
                return []
            names = {save for s, save, _ in named_partials(self.path) if s == step}
            if held is not None and held.step == step:
                names |= {MANIFEST_FILE, held.save_id}
            return sorted(names)

        return await asyncio.to_thread(list_sync)

    async def walk(self, prefix: str = "") -> list[ObjectInfo]:
        """The committed step's manifest and objects, and each partial file (as the object
        ``<step>/<save id>/partial``: what ``aiosnap gc`` removes once it is old)."""

        def walk_sync() -> list[ObjectInfo]:
            found = []
            for step, save_id, path in named_partials(self.path):
                with suppress(FileNotFoundError):
                    stat = path.stat()
                    found.append(ObjectInfo(f"{step_dir(step)}/{save_id}/partial", stat.st_size, stat.st_mtime))
            versions = self._versions
            version = versions.use_current()
            if version is not None:
                try:
                    mtime = os.fstat(version.fd).st_mtime
                    trailer = version.trailer
                    found.append(ObjectInfo(manifest_name(trailer.step), trailer.manifest_nbytes, mtime))
                    with suppress(CorruptCheckpointError):
                        found += [
                            ObjectInfo(name, size, mtime) for name, (_, size) in versions.objects_of(version).items()
                        ]
                finally:
                    versions.release(version)
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
        self._committer.unlink(step, save_id)
        if partials:
            self._writer.discard(step, save_id)
            for found_step, found_save, path in named_partials(self.path):  # other processes', and crashes'
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
        self._versions.retire_all()
        self._writer.close()  # an unnamed partial file is gone with it; a named one stays for gc or a resume


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


def _manifest_step(name: str) -> int | None:
    """The step whose manifest ``name`` is, or None for any other name."""
    folder, _, leaf = name.partition("/")
    return parse_step_dir(folder) if leaf == MANIFEST_FILE else None


def _refuse_other_files(url: str) -> None:
    """:class:`ConfigError` for an existing file that is no checkpoint (neither a zip, as
    ``torch.save`` and aiosnap write them, nor a legacy pickle, nor empty): its first save
    would replace it, and a user who passed a YAML config's path would lose the config."""
    path = os.path.expanduser(url)
    with open(path, "rb") as f:
        head = f.read(4)
    if not head or head == b"PK\x03\x04" or head[:1] == b"\x80":
        return
    config_file = path.endswith((".yaml", ".yml", ".json"))
    hint = " (a configuration file? pass aiosnap.load_config(path))" if config_file else ""
    raise ConfigError(f"{url} is a file that is not a checkpoint{hint}; not opening it as one, nothing was written")


def storage_for(url: str, config: Config | None = None) -> Storage:
    """The backend for a checkpoint location: a local path that is a file is a single-file
    checkpoint (a Lightning checkpoint saved through aiosnap, say); a local folder holding a
    DCP checkpoint (its ``.metadata``) is that checkpoint, read-only (see
    :func:`aiosnap.interop.dcp.api.checkpoint_storage`); anything else is the root
    :func:`~aiosnap.storage.registry.storage_from_url` makes."""
    if "://" not in url and os.path.isfile(os.path.expanduser(url)):
        _refuse_other_files(url)
        return ArchiveStorage.for_config(url, config)
    if "://" not in url and is_dcp_checkpoint(url):
        return checkpoint_storage(url, config)
    return storage_from_url(url, config)
