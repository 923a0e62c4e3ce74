"""Local or shared file system storage through aiofiles.

Each object is written to a temporary name in its final directory, flushed, fsynced and
renamed into place, then the directory is fsynced: a crash leaves either the old object,
the new one, or an ignorable ``.*.tmp`` file, never a half-written object under its name.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import shutil
import uuid
from contextlib import suppress
from pathlib import Path

import aiofiles
import aiofiles.os

from ..names import check_object_name
from .base import BytesLike, ObjectInfo, Storage, complete_before_cancel

__all__ = ["LocalStorage"]

_fsync = aiofiles.os.wrap(os.fsync)


def _fsync_dir_sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durably(folder: Path, attempts: int = 5) -> None:
    """``mkdir -p folder``, fsyncing the parent of every folder it creates, so that a new
    object's path survives a power loss, not only its bytes. An empty parent removed
    meanwhile by a concurrent cleanup (:meth:`LocalStorage.remove_empty_folder`) is made
    again."""
    for attempt in range(attempts):
        missing: list[Path] = []
        probe = folder
        while not probe.is_dir():
            missing.append(probe)
            if probe.parent == probe:
                break
            probe = probe.parent
        try:
            for created in reversed(missing):
                try:
                    created.mkdir()
                except FileExistsError:
                    if not created.is_dir():
                        raise
                    continue
                _fsync_dir_sync(created.parent)
            return
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise


def _copy_file_sync(source: str, path: Path) -> None:
    """Copy (kernel-side where possible), fsync, rename into place, fsync the directory."""
    makedirs_durably(path.parent)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        shutil.copyfile(source, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir_sync(path.parent)


_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK, errno.EXDEV}
_RENAME_NOREPLACE = 1


def _rename_noreplace(source: Path, target: Path) -> bool:
    """Linux renameat2(RENAME_NOREPLACE): atomic, fails with FileExistsError when ``target``
    exists. False when this kernel or file system has no such call."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(source), at_fdcwd, os.fsencode(target), _RENAME_NOREPLACE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(target))


def publish_if_absent(tmp: Path, path: Path) -> None:
    """Put the finished file ``tmp`` at ``path`` unless something is there already
    (FileExistsError), atomically: a hard link (then ``tmp`` is removed); without hard links
    (vfat, gcsfuse, s3fs mounts), renameat2 with
    (not atomic for readers, but never an overwrite; a reader of a manifest caught half
    written sees its checksum fail). Runs on a worker thread."""
    try:
        os.link(tmp, path)
        os.remove(tmp)
        return
    except OSError as exc:
        if isinstance(exc, FileExistsError) or exc.errno not in _NO_HARD_LINKS:
            raise
    if _rename_noreplace(tmp, path):
        return
    lock = path.with_name(f".{path.name}.lock")
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        raise FileExistsError(
            f"{path}: another writer is publishing it (or {lock.name} was left by a crash: remove it)"
        ) from None
    try:
        if path.exists():
            raise FileExistsError(f"{path} exists")
        os.rename(tmp, path)
    finally:
        os.close(fd)
        os.remove(lock)


def _remove_tree(path: Path) -> None:
    """Delete a folder and everything in it; a symlinked folder: its target's contents and
    the link (the data lives on the other disk)."""
    if path.is_symlink():
        with suppress(FileNotFoundError):
            shutil.rmtree(path.resolve())
        path.unlink(missing_ok=True)
        return
    with suppress(FileNotFoundError):
        shutil.rmtree(path)


def _remove_if_empty(path: Path) -> None:
    """rmdir ``path`` if empty (a symlinked folder: the empty target, then the link)."""
    with suppress(FileNotFoundError, NotADirectoryError):
        if os.listdir(path):
            return
        with suppress(OSError):  # filled again meanwhile
            if path.is_symlink():
                path.resolve().rmdir()
                path.unlink()
            else:
                path.rmdir()


class LocalStorage(Storage):
    """Objects are files under ``root``; names map to relative paths."""

    settled_writes = True

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)

    def _path(self, name: str) -> Path:
        """Names are normalised (no ``..``, not absolute); a symlink inside the root (a step
        moved to another disk and linked back) is followed: whoever can write the root is
        trusted with where its folders live."""
        if name == "":
            return self.root
        return self.root / check_object_name(name.rstrip("/"))

    async def check_root(self) -> None:
        if not await aiofiles.os.path.exists(self.root):
            raise FileNotFoundError(f"{self.url}: no such checkpoint root")
        if not await aiofiles.os.path.isdir(self.root):
            raise NotADirectoryError(f"{self.url}: is a file, not a checkpoint root")

    async def write(self, name: str, data: BytesLike, *, if_absent: bool = False) -> None:
        await complete_before_cancel(self._write(self._path(name), data, if_absent))

    async def _write(self, path: Path, data: BytesLike, if_absent: bool) -> None:
        await asyncio.to_thread(makedirs_durably, path.parent)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            async with aiofiles.open(tmp, "wb") as f:
                await f.write(data)
                await f.flush()
                await _fsync(f.fileno())
            if if_absent:
                await asyncio.to_thread(publish_if_absent, tmp, path)
            else:
                await aiofiles.os.replace(tmp, path)
        except BaseException:
            with suppress(OSError):
                await aiofiles.os.remove(tmp)
            raise
        await asyncio.to_thread(_fsync_dir_sync, path.parent)

    async def write_file(self, name: str, path: str) -> None:
        await complete_before_cancel(asyncio.to_thread(_copy_file_sync, path, self._path(name)))

    async def read(self, name: str, *, limit: int | None = None) -> bytes:
        async with aiofiles.open(self._path(name), "rb") as f:
            return await f.read(-1 if limit is None else limit + 1)

    async def size(self, name: str) -> int:
        path = self._path(name)
        if not await aiofiles.os.path.isfile(path):
            raise FileNotFoundError(f"{self.url}: no such object {name!r}")
        return int(await aiofiles.os.path.getsize(path))

    async def read_into(self, name: str, offset: int, dest: memoryview) -> int:
        return await complete_before_cancel(self._read_into(self._path(name), offset, dest))

    async def _read_into(self, path: Path, offset: int, dest: memoryview) -> int:
        async with aiofiles.open(path, "rb", buffering=0) as f:
            await f.seek(offset)
            total = 0
            while total < len(dest):
                n = await f.readinto(dest[total:])
                if not n:
                    break
                total += n
            return total

    async def exists(self, name: str) -> bool:
        return bool(await aiofiles.os.path.isfile(self._path(name)))

    async def list_children(self, prefix: str = "") -> list[str]:
        try:
            return sorted(await aiofiles.os.listdir(self._path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    async def delete(self, name: str) -> None:
        with suppress(FileNotFoundError):
            await aiofiles.os.remove(self._path(name))

    async def delete_prefix(self, prefix: str) -> None:
        path = self._path(prefix)
        if path == self.root:
            raise ValueError("refusing to delete the whole storage root")
        if await aiofiles.os.path.isfile(path):
            await self.delete(prefix)
            return
        await asyncio.to_thread(_remove_tree, path)

    async def walk(self, prefix: str = "") -> list[ObjectInfo]:
        return await asyncio.to_thread(self._walk_sync, self._path(prefix))

    def _walk_sync(self, top: Path) -> list[ObjectInfo]:
        """Every file below ``top``, following symlinked folders once each (no loops)."""
        found = []
        seen: set[tuple[int, int]] = set()
        for folder, folders, files in os.walk(top, followlinks=True):
            with suppress(OSError):
                here = os.stat(folder)
                if (here.st_dev, here.st_ino) in seen:
                    folders.clear()
                    continue
                seen.add((here.st_dev, here.st_ino))
            for name in files:
                path = Path(folder, name)
                with suppress(FileNotFoundError):
                    stat = path.stat()
                    found.append(ObjectInfo(path.relative_to(self.root).as_posix(), stat.st_size, stat.st_mtime))
        return sorted(found, key=lambda o: o.name)

    async def remove_empty_folder(self, prefix: str = "") -> None:
        await asyncio.to_thread(_remove_if_empty, self._path(prefix))
