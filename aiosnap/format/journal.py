"""The spool journal of one save: append-only, one record per event, each fsynced (those
of chunks spilled during capture: with the ``captured`` record).

``<spool>/<save id>/journal.jsonl`` holds lines ``<crc32c, 8 hex digits> <JSON>``:

- ``begin``: the save (id, step, target root, the checkpointer's own root, retention) and
  its :class:`~aiosnap.format.spec.SaveSpec` (the manifest to commit, crc32c aside);
- ``spooled``: chunk N's file is on the spool disk, with its crc32c and those of its
  pieces (spilled during capture, the file and this record are fsynced before ``captured``
  is written; otherwise at once);
- ``landed``: chunk N is in storage, with the crc32c of its pieces (written *before* the
  chunk's spool file is deleted);
- ``captured``: every byte was captured (written before ``save()`` returns).

A crash can tear only the last line of a journal that says ``captured``, which a reader
ignores (one without ``captured`` is never resumed, however it ends). Everything else is untrusted
input when read back: :func:`read_journal` validates every record, the manifest the spec
makes fully, and that the pieces match the manifest's ranges, before resume acts on any of
it.

:class:`JournalWriter` runs its file I/O on a worker thread and completes each append even
if cancelled (no record can land after the save's cleanup).
"""

from __future__ import annotations

import asyncio
import errno
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator
from pydantic_core import PydanticSerializationError, to_json

from ..core import durable
from ..core.aio import complete_before_cancel
from ..core.checksums import crc32c_of
from ..core.names import check_save_id
from ..errors import AiosnapError
from .manifest import MAX_MANIFEST_BYTES, Checksums, Manifest, build_manifest, checked_json
from .merge import merge_parts
from .parts import build_part
from .placement import Landing, Placed, landed_manifest
from .spec import SaveSpec
from .values import json_int

__all__ = [
    "JOURNAL", "JournalError", "JournalState", "JournalWriter", "RankPartJournal", "begin_record", "manifest_of_spec",
    "read_journal",
]  # fmt: skip

JOURNAL = "journal.jsonl"
FORMAT = 3
MAX_JOURNAL_BYTES = 2 * MAX_MANIFEST_BYTES


class JournalError(AiosnapError, ValueError):
    """A spool journal that cannot be trusted (the save it describes is not resumed)."""


class RankPartJournal(JournalError):
    """A valid journal of one rank's part of a multi-rank save, which no spool can finish."""


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class Begin(_Record):
    kind: Literal["begin"]
    format: Literal[3]
    save_id: str
    step: int = Field(ge=0)
    storage_url: str = Field(min_length=1, max_length=4096)
    owner_url: str = Field(min_length=1, max_length=4096)
    keep_last: int | None = Field(ge=1)
    spec: dict[str, Any]

    _check_save_id = field_validator("save_id")(check_save_id)


_Crc = Field(ge=0, lt=2**32)


class Spooled(_Record):
    kind: Literal["spooled"]
    chunk: int = Field(ge=0)
    crc: int = _Crc
    pieces: list[int]
    digests: list[Annotated[str, Field(pattern="^[0-9a-f]{32}$")]] | None = None


_S = Strict()
_Placed = Annotated[
    tuple[
        Annotated[str, _S],
        Annotated[int, _S, Field(ge=0, lt=2**63)],
        Annotated[str, _S, Field(pattern="^[0-9a-f]{32}$")] | None,
    ],
    Strict(False),
]  # JSON arrays for tuples, every item strictly typed
_Codec = Annotated[
    tuple[
        Annotated[int, _S, Field(gt=0, lt=2**63)],
        Annotated[int, _S, Field(ge=0, lt=2**32)],
        Annotated[int, _S, Field(ge=2, le=16)] | None,
    ],
    Strict(False),
]
_Reference = Annotated[
    tuple[Annotated[str, _S], Annotated[int, _S, Field(ge=0, lt=2**31)], Annotated[int, _S, Field(ge=0, lt=2**63)]],
    Strict(False),
]


class Landed(_Record):
    """Chunk ``chunk`` is in storage: its pieces' crc32c; with an incremental save, also
    the bytes of its own object (``stored``), where each piece is (``placed``: object,
    offset, digest) and the earlier steps' objects it names (``references``)."""

    kind: Literal["landed"]
    chunk: int = Field(ge=0)
    pieces: list[int]
    stored: int | None = Field(default=None, ge=0, lt=2**63)
    placed: list[_Placed] | None = None
    references: list[_Reference] | None = None
    codecs: list[_Codec | None] | None = None
    """Of each piece stored compressed: [stored size, crc32c of the frame, shuffle or null]."""


class Captured(_Record):
    kind: Literal["captured"]


_KINDS: dict[str, type[_Record]] = {"begin": Begin, "spooled": Spooled, "landed": Landed, "captured": Captured}


def begin_record(spec: SaveSpec, *, storage_url: str, owner_url: str, keep_last: int | None) -> dict[str, Any]:
    """The first record of a save's journal (see :class:`Begin`)."""
    return {
        "kind": "begin",
        "format": FORMAT,
        "save_id": spec.save_id,
        "step": spec.step,
        "storage_url": storage_url,
        "owner_url": owner_url,
        "keep_last": keep_last,
        "spec": spec.to_document(),
    }


def _line(record: dict[str, Any]) -> bytes:
    """One journal line. Written by pydantic's serializer, as manifests are: the same
    nesting bound, and ints written whatever the process's digit limit; by ``json`` when
    that cannot (a lone surrogate in a root's path, which ``json`` escapes). OSError if
    neither can: the save goes on without its journal (see the callers)."""
    try:
        body = to_json(record)
    except PydanticSerializationError:
        try:
            body = json.dumps(record, separators=(",", ":")).encode("ascii")
        except (ValueError, TypeError, RecursionError) as exc:
            raise OSError(errno.EINVAL, f"a journal record cannot be written as JSON: {str(exc)[:200]}") from None
    return f"{crc32c_of(body):08x} ".encode() + body + b"\n"


class JournalWriter:
    """Appends records to one journal; every append is on disk when it returns, unless
    made with ``sync=False``: then the next synced append makes it durable (one fsync of
    the file covers every earlier append), and the folder is the caller's to fsync."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._created = False

    async def append(self, *records: dict[str, Any], sync: bool = True) -> None:
        data = b"".join(_line(r) for r in records)
        create = not self._created
        await complete_before_cancel(asyncio.to_thread(_append, self.path, data, create, sync))
        self._created = True


def _append(path: Path, data: bytes, create: bool, sync: bool) -> None:
    if create:  # a save with nothing spooled has no folder yet
        path.parent.mkdir(exist_ok=True)
    durable.append(path, data, new_name=create, sync=sync)


@dataclass
class JournalState:
    """What a journal says about its save."""

    begin: Begin
    spec: SaveSpec
    manifest: Manifest
    """The manifest the spec makes, every crc32c still 0."""
    captured: bool = False
    spooled: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    """Chunk -> (crc32c of its spool file, crc32c of its pieces)."""
    landed: dict[int, list[int]] = field(default_factory=dict)
    """Chunk -> crc32c of its pieces."""
    digests: dict[int, list[str]] = field(default_factory=dict)
    """Chunk -> xxh3-128 of its pieces, as spooled."""
    landings: dict[int, Landing] = field(default_factory=dict)
    """Chunk -> where its pieces landed (an incremental save's chunks)."""

    def chunk_names(self) -> list[str]:
        return [o.name for o in self.manifest.objects]

    def pieces(self, chunk: int) -> list[tuple[int, int]]:
        """(offset, nbytes) of the byte ranges in ``chunk``'s object, by offset."""
        return _piece_ranges(self.manifest)[chunk]

    def stored_size(self, chunk: int) -> int:
        """The bytes chunk ``chunk``'s own object holds once landed (an incremental save's
        may hold fewer than planned, or none)."""
        landing = self.landings.get(chunk)
        return self.manifest.objects[chunk].nbytes if landing is None else landing.stored

    def final_manifest(self) -> Manifest:
        """The manifest to commit: the spec's, with every piece's crc32c (and, when a chunk
        landed incrementally, where each piece is)."""
        manifest = manifest_of_spec(self.spec, self.checksums())
        if not self.landings:  # written as planned (incremental saves journal their landings)
            return manifest
        landings = []
        for index, chunk in enumerate(self.spec.chunks):
            landing = self.landings.get(index)
            if landing is None:  # written whole, where the plan put it
                crcs = self.landed.get(index) or self.spooled.get(index, (0, []))[1]
                found: list[str | None] = list(self.digests.get(index, [None] * len(crcs)))
                landing = Landing(chunk.nbytes, tuple(
                    Placed(chunk.object_name, p.dst_offset, crc, digest)
                    for p, crc, digest in zip(chunk.pieces, crcs, found, strict=True)
                ))  # fmt: skip
            landings.append(landing)
        if self.spec.distributed is not None:  # a one-rank job saved in the multi-rank format
            return merge_parts(self.spec, {self.spec.rank: build_part(self.spec, self.checksums(), landings)})
        plan = [(c.object_name, [p.dst_offset for p in c.pieces]) for c in self.spec.chunks]
        return landed_manifest(manifest, plan, landings)

    def checksums(self) -> Checksums:
        """Every piece's crc32c, keyed like the manifest's ranges."""
        crcs: Checksums = {}
        for chunk, ranges in enumerate(_piece_ranges(self.manifest)):
            pieces = self.landed.get(chunk) or self.spooled.get(chunk, (0, []))[1]
            name = self.manifest.objects[chunk].name
            crcs.update({(name, offset): crc for (offset, _), crc in zip(ranges, pieces, strict=True)})
        return crcs


def manifest_of_spec(spec: SaveSpec, crcs: Checksums | None = None) -> Manifest:
    """The manifest a save made by one process commits (see
    :func:`~aiosnap.format.manifest.build_manifest`): of a one-rank job saved in the
    multi-rank format too (rank-local values, or DTensors on a mesh of one device), its only
    part merged as its coordinator merges it. ValueError for a part of a larger job (its
    coordinator commits it) or a spec that is not consistent. Not validated: see
    :func:`~aiosnap.format.manifest.checked_json`."""
    if spec.distributed is None or spec.world_size != 1:
        return build_manifest(spec, crcs)
    if crcs is None:
        crcs = {(c.object_name, p.dst_offset): 0 for c in spec.chunks for p in c.pieces}
    return merge_parts(spec, {spec.rank: build_part(spec, crcs)})


def _piece_ranges(manifest: Manifest) -> list[list[tuple[int, int]]]:
    """For each object, in order, its byte ranges (offset, nbytes), ascending (of whole
    entries, shards and rank-local values alike)."""
    index = {o.name: i for i, o in enumerate(manifest.objects)}
    ranges: list[list[tuple[int, int]]] = [[] for _ in manifest.objects]
    for _, r in manifest.all_ranges():
        ranges[index[r.object]].append((r.offset, r.nbytes))
    return [sorted(found) for found in ranges]


def _parse_line(line: bytes) -> dict[str, Any]:
    head, _, body = line.partition(b" ")
    if len(head) != 8 or f"{crc32c_of(body):08x}".encode() != head:
        raise ValueError("checksum mismatch")
    doc = json.loads(body, parse_int=json_int)  # the readers' digit bound, whatever the process's
    if not isinstance(doc, dict):
        raise ValueError("not a record")
    return doc


def read_journal(path: Path, save_id: str) -> JournalState:
    """Read and validate the journal of ``save_id`` (caller's thread); JournalError says
    why it cannot be trusted. A torn last line (a crash mid-append) is ignored."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_JOURNAL_BYTES + 1)
    except OSError as exc:
        raise JournalError(f"cannot read the journal: {exc.strerror or exc}") from None
    if len(data) > MAX_JOURNAL_BYTES:
        raise JournalError("the journal is too large")
    lines = data.split(b"\n")
    complete, tail = lines[:-1], lines[-1]  # ``tail``: what followed the last newline (torn)
    del tail
    records: list[_Record] = []
    for number, line in enumerate(complete, start=1):
        try:
            doc = _parse_line(line)
            kind = _KINDS.get(doc.get("kind"))  # type: ignore[arg-type]
            if kind is None:
                raise ValueError(f"unknown record kind {doc.get('kind')!r:.40}")
            records.append(kind.model_validate(doc))
        except (ValueError, TypeError, RecursionError, ValidationError) as exc:
            if number == len(complete) and isinstance(exc, ValueError) and "checksum" in str(exc):
                break  # torn by a crash while it was appended: the record never happened
            raise JournalError(f"line {number}: {_short(exc)}") from None
    if not records or not isinstance(records[0], Begin):
        raise JournalError("no begin record")
    begin = records[0]
    if begin.save_id != save_id:
        raise JournalError(f"it describes save {begin.save_id!r}, not the folder's {save_id!r}")
    try:
        spec = SaveSpec.from_document(begin.spec)
        if spec.world_size > 1:
            raise RankPartJournal(
                f"it holds rank {spec.rank} of {spec.world_size}'s part of a multi-rank save of step {spec.step}, "
                "which commits only while all its ranks run (the coordinator merges every rank's part): no spool "
                "can finish it (the step is committed if the coordinator finished it before the crash)"
            )
        _, manifest = checked_json(manifest_of_spec(spec), "the journal's save")  # as any reader would
    except RankPartJournal:
        raise
    except Exception as exc:  # whatever a forged spec makes fail: never a crash of the caller
        raise JournalError(f"its save spec cannot be trusted: {_short(exc)}") from None
    if manifest.save_id != save_id or manifest.step != begin.step:
        raise JournalError("its manifest belongs to another save")
    state = JournalState(begin, spec, manifest)
    offsets = _piece_ranges(manifest)
    for record in records[1:]:
        if isinstance(record, Begin):
            raise JournalError("a second begin record")
        if isinstance(record, Captured):
            state.captured = True
            continue
        assert isinstance(record, (Spooled, Landed))
        if record.chunk >= len(offsets) or len(record.pieces) != len(offsets[record.chunk]):
            raise JournalError(f"a record for chunk {record.chunk} does not match the manifest")
        if any(not 0 <= crc < 2**32 or type(crc) is not int for crc in record.pieces):
            raise JournalError(f"chunk {record.chunk}: invalid piece checksum")
        if isinstance(record, Spooled):
            state.spooled[record.chunk] = (record.crc, list(record.pieces))
            if record.digests is not None:
                if len(record.digests) != len(record.pieces):
                    raise JournalError(f"chunk {record.chunk}: digests do not match its pieces")
                state.digests[record.chunk] = list(record.digests)
        else:
            state.landed[record.chunk] = list(record.pieces)
            landing = _landing_of(state.spec, record)
            if landing is not None:
                state.landings[record.chunk] = landing
    return state


def _landing_of(spec: SaveSpec, record: Landed) -> Landing | None:
    """Where a ``landed`` record says its chunk's pieces are (None: where the plan put
    them); JournalError when that cannot be (the final manifest is checked again, fully,
    as every reader would, before it is committed)."""
    fields = (record.stored, record.placed, record.references)
    if all(f is None for f in fields):
        return None
    if any(f is None for f in fields) or spec.archive is not None:
        raise JournalError(f"chunk {record.chunk}: an incomplete or misplaced incremental landing")
    assert record.stored is not None
    assert record.placed is not None
    assert record.references is not None
    chunk = spec.chunks[record.chunk]
    referenced = {name: size for name, _, size in record.references}
    if len(record.placed) != len(chunk.pieces) or record.stored > chunk.nbytes:
        raise JournalError(f"chunk {record.chunk}: its landing does not match its pieces")
    codecs = record.codecs if record.codecs is not None else [None] * len(record.placed)
    if len(codecs) != len(record.placed):
        raise JournalError(f"chunk {record.chunk}: its compression fields do not match its pieces")
    pieces = []
    for piece, (name, offset, digest), crc, codec in zip(
        chunk.pieces, record.placed, record.pieces, codecs, strict=True
    ):
        extent = piece.nbytes if codec is None else codec[0]
        if codec is not None and not 0 < extent < piece.nbytes:  # a frame is smaller than its range, or not kept
            raise JournalError(f"chunk {record.chunk}: a compressed piece of {piece.nbytes} bytes stores {extent}")
        own = name == chunk.object_name and offset + extent <= record.stored
        if not own and not (name in referenced and offset + extent <= referenced[name]):
            raise JournalError(f"chunk {record.chunk}: a piece landed in {name!r:.120}, which it does not name")
        pieces.append(Placed(name, offset, crc, digest, *(codec or (None, None, None))))
    return Landing(record.stored, tuple(pieces), tuple((n, r, size) for n, r, size in record.references))


def _short(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '/'}: {e['msg']}" for e in exc.errors()[:3])
    return f"{type(exc).__name__}: {str(exc)[:200]}"
