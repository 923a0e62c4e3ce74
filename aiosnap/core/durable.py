"""Durable local-file primitives: one home for fsync, atomic replace, no-overwrite publish.

Plain functions that block; callers run them on worker threads (``asyncio.to_thread``).
Used by the local storage backend, the spool and its journal.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from contextlib import suppress
from pathlib import Path
from typing import Any

__all__ = [
    "append",
    "copy_file_atomically",
    "fsync_dir",
    "fsync_file",
    "makedirs_durably",
    "publish_if_absent",
    "remove_if_empty",
    "remove_tree",
    "start_writeback",
    "temp_name",
    "write_file",
]


def temp_name(path: Path) -> Path:
    """A temporary sibling of ``path`` (``.<name>.<8 hex>.tmp``: ignored by readers)."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")


def write_file(path: Path, data: memoryview | bytes, *, sync: bool = True) -> None:
    """Write ``data`` to ``path`` (created or truncated) and fsync it; with ``sync=False``
    only start writing it back to disk (the caller fsyncs it later, :func:`fsync_file`)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
        else:
            start_writeback(f.fileno())


def append(path: Path, data: bytes, *, new_name: bool, sync: bool = True) -> None:
    """Append ``data`` to ``path`` and fsync it; with ``new_name`` (the file's first
    append) its folder too, so that the name itself survives a crash. ``sync=False``: no
    fsync (a later synced append to the same file makes this one durable too; the folder
    is then the caller's to fsync)."""
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    if new_name and sync:
        fsync_dir(path.parent)


def fsync_file(path: Path) -> None:
    """fsync the file at ``path`` (written earlier without it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing the file's dirty pages to disk now, without waiting
    (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so that a later fsync finds little
    left to write; nothing where the call is missing. No durability by itself."""
    call = _sync_file_range()
    if call is not None:
        call(fd, ctypes.c_int64(0), ctypes.c_int64(0), _SYNC_FILE_RANGE_WRITE)  # errors: the fsync reports them


def _sync_file_range() -> Any:
    global _SYNC_FILE_RANGE
    if _SYNC_FILE_RANGE is None:
        try:
            _SYNC_FILE_RANGE = ctypes.CDLL(None, use_errno=True).sync_file_range
        except (OSError, AttributeError):
            _SYNC_FILE_RANGE = False
    return _SYNC_FILE_RANGE or None


_SYNC_FILE_RANGE: Any = None


def fsync_dir(path: Path) -> None:
    """fsync a folder, so that the names in it (new, renamed, removed) survive a power loss."""
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
                fsync_dir(created.parent)
            return
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise


def copy_file_atomically(source: str, path: Path, if_absent: bool = False) -> None:
    """Copy (kernel-side where possible), fsync, rename into place (with ``if_absent``,
    :func:`publish_if_absent`), fsync the directory."""
    makedirs_durably(path.parent)
    tmp = temp_name(path)
    try:
        shutil.copyfile(source, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if if_absent:
            publish_if_absent(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


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
    (vfat, gcsfuse, s3fs mounts), renameat2 with RENAME_NOREPLACE; failing that, an
    exclusive lock file beside ``path`` (``.<name>.lock``), then a check and a plain rename.
    A lock left by a crash makes later attempts fail with an error naming it (``aiosnap gc``
    removes it after its grace period)."""
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


def remove_tree(path: Path) -> None:
    """Delete a folder and everything in it; a symlinked folder: its target's contents and
    the link (the data lives on the other disk)."""
    if path.is_symlink():
        with suppress(FileNotFoundError):
            shutil.rmtree(path.resolve())
        path.unlink(missing_ok=True)
        return
    with suppress(FileNotFoundError):
        shutil.rmtree(path)


def remove_if_empty(path: Path) -> None:
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
