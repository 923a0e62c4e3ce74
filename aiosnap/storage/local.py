"""Local or shared file system storage through aiofiles.

Each object is written to a temporary name in its final directory, flushed, fsynced and
renamed into place, then the directory is fsynced: a crash leaves either the old object,
the new one, or an ignorable ``.*.tmp`` file, never a half-written object under its name.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import stat
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
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
    write_file,
)
from ..core.names import check_object_name
from ..core.progress import report_sent
from .base import BytesLike, ObjectInfo, PartRecord, Storage, in_control_lane, preadv_all

__all__ = ["LocalStorage"]

_fsync = aiofiles.os.wrap(os.fsync)

_CONTROL_THREADS = 2
_control_pool: ThreadPoolExecutor | None = None
_control_lock = threading.Lock()


def _control_executor() -> ThreadPoolExecutor:
    """The threads that write control objects (:meth:`Storage.write_marker`), apart from the
    loop's default executor, where data writes queue behind each other's fsyncs."""
    global _control_pool
    with _control_lock:
        if _control_pool is None:
            _control_pool = ThreadPoolExecutor(_CONTROL_THREADS, thread_name_prefix="aiosnap-markers")
        return _control_pool


def _write_small(path: Path, data: BytesLike, if_absent: bool) -> None:
    """Blocking: :meth:`LocalStorage.write` of a small object, all on the calling thread."""
    makedirs_durably(path.parent)
    tmp = temp_name(path)
    try:
        write_file(tmp, memoryview(data))
        if if_absent:
            publish_if_absent(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(path.parent)


WRITE_PIECE = 16 * 1024 * 1024
"""Bytes written per call (each reported as sent: a save to a slow shared file system shows
progress within its chunks)."""


class LocalStorage(Storage):
    """Objects are files under ``root``; names map to relative paths."""

    settled_writes = True
    conditional_writes = True

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
        if in_control_lane():  # a heartbeat or verdict: never behind the data writes' fsyncs
            await asyncio.get_running_loop().run_in_executor(_control_executor(), _write_small, path, data, if_absent)
            return
        await asyncio.to_thread(makedirs_durably, path.parent)
        tmp = temp_name(path)
        try:
            async with aiofiles.open(tmp, "wb") as f:
                view = memoryview(data).cast("B")
                for start in range(0, len(view), WRITE_PIECE):  # a piece at a time: progress on a slow disk
                    piece = view[start : start + WRITE_PIECE]
                    await f.write(piece)
                    report_sent(len(piece))
                    del piece
                del view
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

    async def write_file(self, name: str, path: str, *, if_absent: bool = False) -> None:
        await complete_before_cancel(asyncio.to_thread(copy_file_atomically, path, self._path(name), if_absent))

    # -- an object written in parts: a temporary file beside it, written at offsets in any
    #    order (by any process sharing the file system), fsynced and renamed over it at the end

    async def start_upload(self, name: str) -> str:
        path = self._path(name)
        await asyncio.to_thread(makedirs_durably, path.parent)
        tmp = temp_name(path)
        await asyncio.to_thread(_create_empty, tmp)
        return tmp.name

    def _upload_path(self, name: str, token: str) -> Path:
        path = self._path(name)
        if not isinstance(token, str) or not re.fullmatch(rf"\.{re.escape(path.name)}\.[0-9a-f]{{8}}\.tmp", token):
            raise ValueError(f"{self.url}: {token!r:.80} is not an upload of {name!r}")
        return path.with_name(token)

    async def upload_part(self, name: str, token: str, number: int, offset: int, data: memoryview) -> PartRecord:
        tmp = self._upload_path(name, token)
        await complete_before_cancel(asyncio.to_thread(_write_at, tmp, offset, data))
        return {"number": number, "offset": offset, "nbytes": len(data)}

    async def complete_upload(self, name: str, token: str, parts: list[PartRecord]) -> None:
        tmp, path = self._upload_path(name, token), self._path(name)
        position = 0
        for part in sorted(parts, key=lambda p: int(p["offset"])):
            if part["offset"] != position:
                raise ValueError(f"{self.url}: {name!r}: the parts leave a gap or overlap at byte {position}")
            position += int(part["nbytes"])
        await complete_before_cancel(asyncio.to_thread(_finish_file, tmp, path, position))

    async def abort_upload(self, name: str, upload_id: str) -> None:
        with suppress(FileNotFoundError):
            await aiofiles.os.remove(self._upload_path(name, upload_id))

    async def read(self, name: str, *, limit: int | None = None) -> bytes:
        return await complete_before_cancel(self._read(self._path(name), limit))  # a cancel left no file open

    @staticmethod
    async def _read(path: Path, limit: int | None) -> bytes:
        async with aiofiles.open(path, "rb", opener=open_regular) as f:
            if limit is None:
                return await f.read()
            # read(n) reserves n bytes first: a limit far above the file's size (1 GiB for a
            # DCP .metadata) must not become an allocation of that much
            size = os.fstat(f.fileno()).st_size
            parts: list[bytes] = []
            total = 0
            while total <= limit:
                part = await f.read(min(limit + 1 - total, max(size + 1 - total, 1024**2)))
                if not part:
                    break
                parts.append(part)
                total += len(part)
            return b"".join(parts)

    async def size(self, name: str) -> int:
        path = self._path(name)
        if not await aiofiles.os.path.isfile(path):
            raise FileNotFoundError(f"{self.url}: no such object {name!r}")
        return int(await aiofiles.os.path.getsize(path))

    async def read_into(self, name: str, offset: int, dest: memoryview) -> int:
        return await complete_before_cancel(self._read_into(self._path(name), offset, dest))

    async def _read_into(self, path: Path, offset: int, dest: memoryview) -> int:
        async with aiofiles.open(path, "rb", buffering=0, opener=open_regular) as f:
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
        fd = open_regular(str(path), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
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


def _create_empty(path: Path) -> None:
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o644))


def _write_at(path: Path, offset: int, data: memoryview) -> None:
    """Blocking: write ``data`` at ``offset`` of the existing file ``path`` (an upload that
    was aborted has no file any more: FileNotFoundError)."""
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
    finally:
        os.close(fd)


def _finish_file(tmp: Path, path: Path, size: int) -> None:
    """Blocking: check ``tmp`` holds ``size`` bytes, fsync it, rename it over ``path``,
    fsync the folder."""
    fd = os.open(tmp, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    try:
        found = os.fstat(fd).st_size
        if found != size:
            raise ValueError(f"{tmp}: {found} bytes written, the parts add up to {size}")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def open_regular(path: str, flags: int) -> int:
    """``os.open`` for reading an object: a path that is not a regular file (a FIFO, which
    would block the read forever; a device, a directory) is no object: FileNotFoundError.
    Opened without blocking (a FIFO's open waits for a writer otherwise); any thread."""
    fd = os.open(path, flags | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FileNotFoundError(errno.ENOENT, "not a regular file", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
