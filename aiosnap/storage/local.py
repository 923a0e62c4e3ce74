"""Local or shared file system storage through aiofiles.

Each object is written to a temporary name in its final directory, flushed, fsynced and
renamed into place, then the directory is fsynced: a crash leaves either the old object,
the new one, or an ignorable ``.*.tmp`` file, never a half-written object under its name.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

import aiofiles
import aiofiles.os

from ..core.aio import complete_before_cancel
from ..core.durable import (
    copy_file_atomically,
    fsync_dir,
    makedirs_durably,
    publish_if_absent,
    remove_if_empty,
    remove_tree,
    temp_name,
)
from ..core.names import check_object_name
from .base import BytesLike, ObjectInfo, Storage, preadv_all

__all__ = ["LocalStorage"]

_fsync = aiofiles.os.wrap(os.fsync)


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
        tmp = temp_name(path)
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
        await asyncio.to_thread(fsync_dir, path.parent)

    async def write_file(self, name: str, path: str) -> None:
        await complete_before_cancel(asyncio.to_thread(copy_file_atomically, path, self._path(name)))

    async def read(self, name: str, *, limit: int | None = None) -> bytes:
        return await complete_before_cancel(self._read(self._path(name), limit))  # a cancel left no file open

    @staticmethod
    async def _read(path: Path, limit: int | None) -> bytes:
        async with aiofiles.open(path, "rb") as f:
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

    async def read_scatter(self, name: str, offset: int, buffers: Sequence[memoryview]) -> int:
        return await complete_before_cancel(asyncio.to_thread(self._read_scatter, self._path(name), offset, buffers))

    @staticmethod
    def _read_scatter(path: Path, offset: int, buffers: Sequence[memoryview]) -> int:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            return preadv_all(fd, buffers, offset)
        finally:
            os.close(fd)

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
        await asyncio.to_thread(remove_tree, path)

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
        await asyncio.to_thread(remove_if_empty, self._path(prefix))
