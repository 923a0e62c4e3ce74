"""Local or shared file system storage through aiofiles.

Each object is written to a temporary name in its final directory, flushed, fsynced and
renamed into place, then the directory is fsynced: a crash leaves either the old object,
the new one, or an ignorable ``.*.tmp`` file, never a half-written object under its name.
"""

from __future__ import annotations

import asyncio
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


class LocalStorage(Storage):
    """Objects are files under ``root``; names map to relative paths."""

    settled_writes = True

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)

    def _path(self, name: str) -> Path:
        if name == "":
            return self.root
        path = self.root / check_object_name(name.rstrip("/"))
        if not path.resolve().is_relative_to(self.root.resolve()):
            raise ValueError(f"object name {name!r} leaves the storage root")
        return path

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
                await aiofiles.os.link(tmp, path)  # fails if path exists: no silent overwrite
                await aiofiles.os.remove(tmp)
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
        with suppress(FileNotFoundError):
            await asyncio.to_thread(shutil.rmtree, path)

    async def walk(self, prefix: str = "") -> list[ObjectInfo]:
        return await asyncio.to_thread(self._walk_sync, self._path(prefix))

    def _walk_sync(self, top: Path) -> list[ObjectInfo]:
        found = []
        for folder, _, files in os.walk(top):
            for name in files:
                path = Path(folder, name)
                with suppress(FileNotFoundError):
                    stat = path.stat()
                    found.append(ObjectInfo(path.relative_to(self.root).as_posix(), stat.st_size, stat.st_mtime))
        return sorted(found, key=lambda o: o.name)

    async def remove_empty_folder(self, prefix: str = "") -> None:
        path = self._path(prefix)
        with suppress(FileNotFoundError, NotADirectoryError):
            if not await aiofiles.os.listdir(path):
                with suppress(OSError):  # filled again meanwhile
                    await aiofiles.os.rmdir(path)
