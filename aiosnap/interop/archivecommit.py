"""The commit of a single-file checkpoint, and the removal of the file at ``P``
(:mod:`aiosnap.interop.singlefile`).

:class:`ArchiveCommit` finishes a save's partial file (its tail: the pickle, the manifest,
the zip central directory) and puts it at ``P``, or unlinks ``P``, under an exclusive
``flock`` of ``P``'s folder, so that the check of what ``P`` holds and the rename or unlink
that depends on it are one step for every process: a ``P`` holding a newer step is never
replaced (StepOrderError), and with ``if_absent`` one that already holds the step is
refused (FileExistsError). Worker threads only (``asyncio.to_thread``), blocking.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

from ..core.durable import fsync_dir
from ..errors import StepOrderError
from ..format.manifest import Manifest
from .archiveversions import ArchiveVersions
from .archivewriter import ArchiveWriter

__all__ = ["ArchiveCommit", "whose_manifest"]

_MANIFEST_HEAD = re.compile(rb'\{"format":"aiosnap","format_version":\d+,"step":(\d+),"save_id":"([0-9a-f]{16})"')


class ArchiveCommit:
    """Puts a save's partial file at ``path``, or removes the file there (``url``: how
    errors name it); ``writer`` holds the saves in progress, ``versions`` the file's open
    versions (retired once ``P`` changed)."""

    def __init__(self, url: str, path: Path, writer: ArchiveWriter, versions: ArchiveVersions) -> None:
        self.url = url
        self.path = path
        self.writer = writer
        self.versions = versions

    def commit(self, step: int, manifest_bytes: bytes, if_absent: bool) -> None:
        """Finish the partial file of the save whose manifest this is and put it at ``P``."""
        named_step, save_id = whose_manifest(manifest_bytes, self.url)
        attempt = self.writer.attempts.get(save_id)
        if attempt is None or named_step != step:
            raise FileNotFoundError(f"{self.url}: no save in progress for step {step} (save {save_id})")
        self.writer.write_tail(attempt, step, manifest_bytes)
        with self.folder_lock():  # another process's commit or removal waits
            held = self.versions.held_trailer()
            if held is not None and held.step > step:
                raise StepOrderError(
                    f"{self.url}: holds step {held.step}, newer than step {step}, committed while this save "
                    "ran: not replacing it"
                )
            if if_absent and held is not None and held.step == step:
                raise FileExistsError(f"{self.url}: step {step} is there already")
            attempt.partial.publish()
            fsync_dir(self.path.parent)
        self.writer.attempts.pop(attempt.spec.save_id, None)
        self.versions.retire_all()

    def unlink(self, step: int, save_id: str | None) -> None:
        """Unlink ``P`` if it holds ``step`` (of ``save_id``, when given)."""
        with self.folder_lock():
            held = self.versions.held_trailer()
            if held is not None and held.step == step and save_id in (None, held.save_id):
                with suppress(FileNotFoundError):
                    self.path.unlink()
        self.versions.retire_all()

    @contextlib.contextmanager
    def folder_lock(self) -> Iterator[None]:
        """Blocking: an exclusive ``flock`` on ``P``'s folder."""
        fd = os.open(self.path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock


def whose_manifest(data: bytes, where: str) -> tuple[int, str]:
    """The step and save id of a manifest being committed: read from its first bytes, as
    :meth:`Manifest.to_json` writes them (a 40,000-entry manifest takes a second to parse,
    and the commit has just built it); anything else is parsed and checked whole."""
    head = _MANIFEST_HEAD.match(data)
    if head is not None:
        return int(head[1]), head[2].decode("ascii")
    manifest = Manifest.from_json(data, f"{where} (manifest being committed)")
    return manifest.step, manifest.save_id
