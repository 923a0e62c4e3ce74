"""The writing side of a single-file checkpoint: the saves in progress to the file ``P``
and their partial files (:mod:`aiosnap.interop.singlefile`, :mod:`.partialfile`).

:class:`ArchiveWriter` remembers, for each save announced to it, where each of its data
objects goes in the file (the plan lays the chunks end to end, the tail after them), and
writes each object with ``pwrite`` at its offset into the save's partial file, from any
number of worker threads, each write on disk (``fdatasync``) before it counts as landed.
:meth:`ArchiveWriter.write_tail` writes the archive's end (the pickle, the manifest, the
zip central directory) before the commit puts the partial file at ``P``.
:meth:`ArchiveWriter.started` runs on the loop thread; the rest on worker threads
(``asyncio.to_thread``).
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path

from ..core.names import check_object_name, check_save_id, step_dir
from ..format.archive import Record, build_tail, data_record_name
from ..format.spec import SaveSpec
from ..storage.base import BytesLike
from .partialfile import PartialFile, partial_name

__all__ = ["ArchiveWriter", "Attempt"]

_COPY_BLOCK = 8 * 1024**2


@dataclass
class Attempt:
    """One save in progress (loop thread creates; worker threads write its partial file)."""

    spec: SaveSpec
    partial: PartialFile
    offsets: dict[str, tuple[int, int]]  # object name -> (offset in the file, size)


class ArchiveWriter:
    """The saves in progress to the file at ``path`` (``url``: how errors name it); their
    partial files are named when ``resumable_partials`` (see :class:`.partialfile.PartialFile`)."""

    def __init__(self, url: str, path: Path, resumable_partials: bool) -> None:
        self.url = url
        self.path = path
        self.resumable_partials = resumable_partials
        self.attempts: dict[str, Attempt] = {}

    def started(self, spec: SaveSpec) -> None:
        """A save to this file starts: remember where its objects go (loop thread)."""
        if spec.archive is None:
            raise ValueError(f"{self.url}: a save to a single-file checkpoint must be planned as one file")
        offsets: dict[str, tuple[int, int]] = {}
        position = 0
        for chunk in spec.chunks:
            offsets[chunk.object_name] = (position, chunk.nbytes)
            position += chunk.nbytes
        if position != spec.archive.tail_offset:
            raise ValueError(f"{self.url}: the save's chunks end at {position}, not at {spec.archive.tail_offset}")
        name = partial_name(self.path, step_dir(spec.step), check_save_id(spec.save_id))
        partial = PartialFile(self.path, name, resumable=self.resumable_partials)
        self.attempts[spec.save_id] = Attempt(spec, partial, offsets)

    def attempt_of(self, name: str) -> Attempt:
        """The save in progress that data object ``name`` belongs to."""
        parts = check_object_name(name).split("/")
        attempt = self.attempts.get(parts[1]) if len(parts) > 2 else None
        if attempt is None:
            raise FileNotFoundError(f"{self.url}: {name!r} is not part of a save in progress here")
        return attempt

    def pwrite(self, attempt: Attempt, offset: int, data: BytesLike, *, sync: bool = True) -> None:
        """Worker thread: ``data`` at ``offset`` of the attempt's partial file."""
        fd = attempt.partial.fd()
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
        if sync:
            os.fdatasync(fd)  # landed means on disk (a resumed spool trusts what landed)

    def copy_in(self, attempt: Attempt, offset: int, nbytes: int, source: str) -> None:
        """Worker thread: the file ``source`` (``nbytes`` long) at ``offset``."""
        if os.path.getsize(source) != nbytes:
            raise ValueError(f"{self.url}: {source} is not the {nbytes} bytes the plan says")
        with open(source, "rb", buffering=0) as f:
            done = 0
            while done < nbytes:
                block = f.read(min(_COPY_BLOCK, nbytes - done))
                if not block:
                    raise OSError(f"{source} ended early")
                self.pwrite(attempt, offset + done, block, sync=done + len(block) == nbytes)
                done += len(block)

    def landed(self, name: str) -> int | None:
        """Worker thread: the size of data object ``name`` of a save in progress (resumed)
        when it has landed in its partial file; None when ``name`` is of no save in
        progress here. FileNotFoundError when it has not landed."""
        attempt = self.attempts.get(name.split("/")[1] if name.count("/") >= 2 else "")
        if attempt is None:
            return None
        offset, nbytes = attempt.offsets.get(name, (0, -1))
        landed = attempt.partial.landed_size()
        if nbytes < 0 or landed is None or landed < offset + nbytes:
            raise FileNotFoundError(f"{self.url}: {name!r} has not landed")
        return nbytes

    def write_tail(self, attempt: Attempt, step: int, manifest_bytes: bytes) -> None:
        """Worker thread: the archive's end after the chunks, the file cut there and fsynced."""
        spec = attempt.spec
        assert spec.archive is not None
        records = [
            Record(data_record_name(index), offset, entry.nbytes)
            for index, (offset, entry) in enumerate(zip(spec.archive.header_offsets, spec.entries, strict=True))
        ]
        tail = build_tail(
            spec.archive.tail_offset, records, base64.b64decode(spec.archive.pickle), manifest_bytes,
            step=step, save_id=spec.save_id,
        )  # fmt: skip
        fd = attempt.partial.fd()
        self.pwrite(attempt, spec.archive.tail_offset, tail)
        os.ftruncate(fd, spec.archive.tail_offset + len(tail))
        os.fsync(fd)

    def discard(self, step: int, save_id: str | None) -> None:
        """Worker thread: drop the saves in progress of ``step`` (of ``save_id``, when
        given) and their partial files."""
        for found_save, attempt in list(self.attempts.items()):
            if attempt.spec.step == step and save_id in (None, found_save):
                self.attempts.pop(found_save, None)
                attempt.partial.discard()

    def close(self) -> None:
        """Close every partial file: an unnamed one is gone with it; a named one stays for
        gc or a resume."""
        for attempt in list(self.attempts.values()):
            attempt.partial.close()
        self.attempts.clear()
