"""The reading side of a single-file checkpoint: the versions of the file at ``P`` open for
reading (:mod:`aiosnap.interop.singlefile`).

:class:`ArchiveVersions` opens the archive at ``P`` as it is now, one open file per save id
(a version), and closes an older version once nobody reads it any more, so that a read that
began before a writer replaced ``P`` finishes on the bytes it began on. Inside
:meth:`ArchiveVersions.reading` every read comes from the version first seen there. The
methods without ``async`` run on worker threads (``asyncio.to_thread``); the version table
is guarded by a lock.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import stat as stat_module
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from ..core.names import check_object_name
from ..errors import ManifestError
from ..format.archive import MAX_TRAILER_BYTES, Trailer, parse_trailer
from ..format.manifest import MAX_MANIFEST_BYTES, Manifest

__all__ = ["ArchiveVersions", "Version"]


class Version:
    """One version of the file at ``P``, open (its fields guarded by the storage's lock)."""

    def __init__(self, fd: int, trailer: Trailer) -> None:
        self.fd = fd  # -1 once closed
        self.trailer = trailer
        self.objects: dict[str, tuple[int, int]] | None = None  # from its manifest, when read
        self.users = 0
        self.retired = False  # a newer version was seen: close when unused


PINNED: contextvars.ContextVar[list[Version] | None] = contextvars.ContextVar("aiosnap_archive_pins", default=None)
"""The versions a :meth:`ArchiveVersions.reading` context keeps open (worker threads started
inside the context see the same list)."""


class ArchiveVersions:
    """The open versions of the archive at ``path`` (``url``: how errors name it)."""

    def __init__(self, url: str, path: Path) -> None:
        self.url = url
        self.path = path
        self._lock = threading.Lock()
        self._versions: dict[str, Version] = {}  # save id -> open version (the current one, and pinned ones)

    def use_current(self) -> Version | None:
        """Worker thread: the version of the file at ``P`` now, open and in use by the caller
        (who releases it), or None when ``P`` is not an aiosnap archive. Older versions are
        closed once nobody reads them. Inside :meth:`reading`, the first version seen is the
        one every later call gets (a snapshot), kept open until the context ends."""
        pins = PINNED.get()
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
                version = self._versions[trailer.save_id] = Version(fd, trailer)
            else:
                os.close(fd)  # the same save: the same bytes
            for other in list(self._versions.values()):
                if other is not version:
                    self._retire(other)
            self._use(version)
        return version

    def use_saved(self, name: str) -> Version:
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
        version = self.use_current()
        if version is None:
            raise FileNotFoundError(f"{self.url}: not an aiosnap checkpoint (yet)")
        if version.trailer.save_id != save_id:
            self.release(version)
            raise FileNotFoundError(f"{self.url}: no object {name!r} in the checkpoint there now")
        return version

    def _use(self, version: Version) -> None:
        """With the lock held: one more user (two inside a reading context: it keeps one)."""
        version.users += 1
        pins = PINNED.get()
        if pins is not None and version not in pins:
            version.users += 1
            pins.append(version)

    def release(self, version: Version) -> None:
        with self._lock:
            version.users -= 1
            if version.retired and version.users == 0:
                self._close_version(version)

    def _retire(self, version: Version) -> None:
        """With the lock held: close ``version`` once nobody reads it."""
        version.retired = True
        if version.users == 0:
            self._close_version(version)

    def _close_version(self, version: Version) -> None:
        if version.fd >= 0:
            os.close(version.fd)
            version.fd = -1
        if self._versions.get(version.trailer.save_id) is version:
            del self._versions[version.trailer.save_id]

    def retire_all(self) -> None:
        with self._lock:
            for version in list(self._versions.values()):
                self._retire(version)

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        """Everything read inside comes from the version of the file first seen inside (a
        snapshot), even when a writer replaces the file meanwhile: a load finds its step,
        reads its manifest and its data from one version."""
        pins: list[Version] = []
        token = PINNED.set(pins)
        try:
            yield
        finally:
            PINNED.reset(token)
            for version in pins:
                self.release(version)

    def held_trailer(self) -> Trailer | None:
        """Worker thread: the trailer of the archive at ``P`` now (None: not an archive)."""
        version = self.use_current()
        if version is None:
            return None
        self.release(version)
        return version.trailer

    def manifest_bytes(self, version: Version) -> bytes:
        trailer = version.trailer
        if trailer.manifest_nbytes > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{self.url}: {trailer.manifest_nbytes} bytes is too large for a manifest")
        return os.pread(version.fd, trailer.manifest_nbytes, trailer.manifest_offset)

    def objects_of(self, version: Version) -> dict[str, tuple[int, int]]:
        """The version's objects (offset in the file, size), from its manifest's object table.
        A load has the whole manifest checked by the catalog already (the same version: see
        :meth:`reading`); here only the table is taken, its types checked, and a table that
        is not well-formed has the whole manifest checked (which raises ManifestError)."""
        if version.objects is None:
            data = self.manifest_bytes(version)
            table = object_table(data)
            if table is None:
                table = [(o.name, o.nbytes) for o in Manifest.from_json(data, self.url).objects]
            objects: dict[str, tuple[int, int]] = {}
            position = 0
            for name, nbytes in table:
                objects[name] = (position, nbytes)
                position += nbytes
            version.objects = objects
        return version.objects

    def object_of(self, version: Version, name: str) -> tuple[int, int]:
        found = self.objects_of(version).get(name)
        if found is None:
            raise FileNotFoundError(f"{self.url}: no object {name!r} in the checkpoint")
        return found


def object_table(data: bytes) -> list[tuple[str, int]] | None:
    """``objects`` of a manifest as (name, size) pairs, or None when it is not well-formed."""
    try:
        table = [(o["name"], o["nbytes"]) for o in json.loads(data)["objects"]]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    if all(type(name) is str and type(nbytes) is int and 0 <= nbytes < 2**63 for name, nbytes in table):
        return table
    return None
