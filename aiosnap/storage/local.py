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

from ..manifest import check_object_name
from .base import BytesLike, ObjectInfo, Storage, complete_before_cancel

__all__ = ["LocalStorage"]

_fsync = aiofiles.os.wrap(os.fsync)


def _fsync_dir_sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_file_sync(source: str, path: Path) -> None:
    """Copy (kernel-side where possible), fsync, rename into place, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
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
        await aiofiles.os.makedirs(path.parent, exist_ok=True)
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

    async def read(self, name: str) -> bytes:
        async with aiofiles.open(self._path(name), "rb") as f:
            return await f.read()

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

    async def remove_root(self) -> None:
        with suppress(FileNotFoundError):
            if not await aiofiles.os.listdir(self.root):
                await aiofiles.os.rmdir(self.root)
