"""Where a single-file save writes before its commit (:mod:`.singlefile`).

A save to the file ``P`` writes its chunks into a *partial file* in ``P``'s folder, which
its commit puts at ``P`` (a rename or link within one file system, so the bytes are never
copied). Two kinds:

- **Unnamed** (the default, on Linux): ``open(folder, O_TMPFILE)``, a file with no name,
  so listings of the folder (``os.listdir``, Lightning's checks, a logger's scan) never see
  it, and when the process that writes it ends in any way (a crash, SIGKILL, a failed
  save) the kernel frees it: nothing is left behind. The commit links it into place:
  ``linkat`` at ``P`` when nothing is there (fails if something appeared), or, to replace a
  file ``P`` already has, at the hidden name below and then ``rename`` over ``P`` (that
  name lives only for the two calls, under the commit's folder lock; a crash between
  them leaves it for ``aiosnap gc``).
- **Named** ``.<P's name>.<step>.<save id>.aiosnap-partial`` beside ``P``: where the file
  system or the platform has no ``O_TMPFILE`` (macOS, some network and FUSE file systems:
  the open fails with EOPNOTSUPP, EISDIR or EINVAL) or no ``/proc/self/fd`` to link it
  from, and for saves that a spool may resume after a crash (``resumable``: the chunks that
  landed must outlive the process). A crash leaves it behind; ``aiosnap gc`` removes it
  after the grace period, a resume finishes it.

Which kind a :class:`PartialFile` writes is settled when it is first opened, by what is on
disk: a named partial file of the same save already there (left by a crash, or by an unnamed
file linked to its hidden name just before the rename) is reopened and written, whatever kind
was asked for, so that what :meth:`PartialFile.landed_size` counts is what the commit
publishes. A name this object did not open is never removed or replaced by it.

Only the process that opened an unnamed file can write or publish it: the upload process
(``upload.executor: process``) makes its own attempts, so the whole save -- writes and
commit -- happens in that one process.

Threads: the storage's worker threads; one lock per file guards its descriptor.
"""

from __future__ import annotations

import errno
import os
import re
import threading
from contextlib import suppress
from pathlib import Path

from ..core.durable import publish_if_absent
from ..core.names import parse_step_dir

__all__ = ["PartialFile", "named_partials", "partial_name"]

_NO_TMPFILE = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EISDIR, errno.EINVAL, errno.ENOSYS}
"""What ``open(O_TMPFILE)`` fails with where the kernel or the file system lacks it."""
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK, errno.EXDEV, errno.ENOENT}
_COPY_BLOCK = 8 * 1024**2
_PARTIAL = re.compile(r"\.(?P<name>.+)\.(?P<step>[0-9]{12,20})\.(?P<save>[0-9a-f]{16})\.aiosnap-partial")


def partial_name(target: Path, step_folder: str, save_id: str) -> Path:
    """The named partial file of one save to ``target`` (also the unnamed file's name for
    the instant between its link and its rename over ``target``)."""
    return target.with_name(f".{target.name}.{step_folder}.{save_id}.aiosnap-partial")


def named_partials(target: Path) -> list[tuple[int, str, Path]]:
    """Blocking: (step, save id, path) of the named partial files of ``target`` (of any
    process; unnamed ones are not listed anywhere)."""
    found = []
    with suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(target.parent):
            match = _PARTIAL.fullmatch(entry.name)
            if match and match["name"] == target.name:
                step = parse_step_dir(match["step"])
                if step is not None:
                    found.append((step, match["save"], Path(entry.path)))
    return found


class PartialFile:
    """One save's partial file (see the module docstring): opened at its first write."""

    def __init__(self, target: Path, name: Path, *, resumable: bool) -> None:
        self.target = target
        self.name = name  # the named file's path (used by a named partial file only)
        self._want_unnamed = not resumable
        self._fd: int | None = None
        self._unnamed = False  # opened without a name (it then has none until its commit)
        self._over = False
        self.lock = threading.Lock()

    def fd(self) -> int:
        """The descriptor to write through (worker thread; opens the file the first time).
        A file whose save is over is never opened again (an unnamed one would come back
        empty)."""
        with self.lock:
            fd = self._open(create=True)
            assert fd is not None
            return fd

    def _open(self, *, create: bool) -> int | None:
        """With the lock held: the file's descriptor, opening it if it is not open yet: the
        named file when it exists already (this save's, left by a crash), else (``create``)
        an unnamed one where wanted and possible, else the named one. None: not open, and
        nothing to open without ``create``."""
        if self._over:
            raise FileNotFoundError(f"{self.target}: the save that wrote {self.name.name} is over")
        if self._fd is not None:
            return self._fd
        flags = os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd = os.open(self.name, flags)  # what landed before a crash: write on into it
        except FileNotFoundError:
            if not create:
                return None
            self._fd = self._open_unnamed() if self._want_unnamed else None
            self._unnamed = self._fd is not None
            if self._fd is None:
                self._fd = os.open(self.name, flags | os.O_CREAT, 0o644)
        return self._fd

    def _open_unnamed(self) -> int | None:
        """An ``O_TMPFILE`` in the target's folder, or None where there is none to be had."""
        flag = getattr(os, "O_TMPFILE", 0)
        if not flag or not os.path.isdir("/proc/self/fd"):
            return None
        try:
            return os.open(self.target.parent, flag | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            if exc.errno in _NO_TMPFILE:
                return None
            raise

    def landed_size(self) -> int | None:
        """Bytes the file this object writes holds so far (None: none yet), for a resumed
        save's check of what landed before a crash: a named file found on disk is opened
        here, so that the writes and the commit that follow go into that very file."""
        with self.lock:
            fd = self._open(create=False)
            return None if fd is None else os.fstat(fd).st_size

    def publish(self) -> None:
        """Worker thread, under the commit's folder lock, the file written and fsynced: put
        it at the target, replacing what is there (the caller checked that it may), then
        close it."""
        fd = self.fd()
        try:
            if self._unnamed:
                if not self.target.exists() and self._link(fd, self.target):
                    return
                self._name_it(fd)  # to rename it over the file there
            if self.target.exists():
                os.replace(self.name, self.target)
            else:
                publish_if_absent(self.name, self.target)
        finally:
            self.close()

    @staticmethod
    def _link(fd: int, where: Path) -> bool:
        """Give the unnamed file ``fd`` the name ``where`` (FileExistsError if it is taken);
        False where this file system cannot link it."""
        folder = os.open(where.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            # src_dir_fd makes os.link call linkat, which follows the /proc link to the file
            os.link(f"/proc/self/fd/{fd}", where.name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=True)
        except OSError as exc:
            if isinstance(exc, FileExistsError) or exc.errno not in _NO_HARD_LINKS:
                raise
            return False
        finally:
            os.close(folder)
        return True

    def _name_it(self, fd: int) -> None:
        """Give the unnamed file its hidden name: a link, or where there can be none, a copy
        (an unnamed file has no other way out). FileExistsError when something has that
        name: not this object's (one left by a crash would have been opened instead)."""
        if self._link(fd, self.name):
            return
        source = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            out = os.open(self.name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o644)
        except BaseException:
            os.close(source)
            raise
        try:
            offset, size = 0, os.fstat(source).st_size
            while offset < size:
                block = os.pread(source, min(_COPY_BLOCK, size - offset), offset)
                if not block:
                    raise OSError(errno.EIO, f"{self.target}: the partial file ended early")
                offset += os.pwrite(out, block, offset)
            os.fsync(out)
        except BaseException:
            with suppress(FileNotFoundError):
                self.name.unlink()  # the copy this call made, and only that
            raise
        finally:
            os.close(out)
            os.close(source)

    def close(self) -> None:
        """Close the file (an unnamed one is gone with it); it is never reopened."""
        with self.lock:
            self._over = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def discard(self) -> None:
        """The save is given up: close the file and remove its name, if it has one."""
        self.close()
        if not self._unnamed:
            with suppress(FileNotFoundError):
                self.name.unlink()
