"""A rank's part of a multi-rank save. Pure code, no I/O.

Each rank writes its part (``<step>/<save id>/rank-<r>.part.json``) after its data objects:
the shared entries it wrote (a plain entry whole, a DTensor's box with its offsets), the
crc32c of the plain tensors it holds that a rank of another class writes (for the merge to
compare), its rank-local values, its class (the table and tree shape it holds; see
:mod:`aiosnap.distributed.ownership`) and its bucket digests. The lowest rank of each class
other than the coordinator also ships that class's ``table`` and ``tree``; the others' entry
numbers refer to it. The coordinator reads every part and checks it as untrusted input
(strict types, every object inside that rank's own folder, the tree against the table, a
crc32c of the document) before merging them (:mod:`aiosnap.format.merge`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..core.names import attempt_of_object, attempt_prefix, check_save_id, object_prefix
from ..errors import ManifestError
from .buckets import BUCKETS
from .dtypes import dtype_itemsize
from .manifest import (
    ByteRange,
    Checksums,
    DataObject,
    EntryRecord,
    RankLocalRecord,
    StoredDigest,
    crc_matches,
    parse_json,
    signed_json,
    validated,
)
from .placement import Landing
from .spec import SaveSpec
from .tree import check_tree, shift_entry_ids

__all__ = [
    "ChecksumRecord", "RankPart", "TableEntry", "WrittenRecord", "build_part", "failed_name",
    "part_name", "spec_table",
]  # fmt: skip

_MAX_INT = 2**63
MAX_PART_BYTES = 64 * 1024**2


def part_name(step: int, save_id: str, rank: int) -> str:
    return f"{attempt_prefix(step, save_id)}/rank-{rank}.part.json"


def failed_name(step: int, save_id: str, rank: int) -> str:
    """Written (best effort) by a rank whose part of the save failed: the coordinator gives
    up at once. (The other markers of a save: :mod:`.markers`.)"""
    return f"{attempt_prefix(step, save_id)}/rank-{rank}.failed"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class WrittenRecord(_Frozen):
    """A shared entry this rank wrote: whole (``offsets`` None) or a DTensor shard."""

    entry: int = Field(ge=0, lt=_MAX_INT)
    shape: list[int]
    offsets: list[int] | None = None
    ranges: list[ByteRange]


class ChecksumRecord(_Frozen):
    """The crc32c of the values of a plain tensor this rank holds but did not write."""

    entry: int = Field(ge=0, lt=_MAX_INT)
    crc32c: int = Field(ge=0, lt=2**32)


class TableEntry(_Frozen):
    """One entry of a class's table: a plain tensor or pickle (its layout on the rank that
    describes it), or a DTensor's box (``shape``: the DTensor's global shape; ``mesh``: its
    device mesh, :func:`~aiosnap.core.placements.mesh_id`)."""

    path: str
    kind: Literal["tensor", "pickle", "sharded"]
    dtype: str
    shape: list[int]
    stride: list[int]
    device: str
    nbytes: int = Field(ge=0, lt=_MAX_INT)
    mesh: int | None = Field(default=None, ge=0, lt=2**32)

    @model_validator(mode="after")
    def _consistent(self) -> TableEntry:
        itemsize = dtype_itemsize(self.dtype)
        if (
            len(self.shape) > 64
            or any(not 0 <= d < _MAX_INT for d in self.shape)
            or len(self.stride) != len(self.shape)
        ):
            raise ValueError(f"{self.path}: invalid shape {self.shape} or stride {self.stride}")
        if (self.kind == "sharded") != (self.mesh is not None):
            raise ValueError(f"{self.path}: a mesh belongs to DTensor boxes, and only to them")
        if self.kind == "tensor" and math.prod(self.shape) * itemsize != self.nbytes:
            raise ValueError(f"{self.path}: shape {self.shape} of {self.dtype} is not {self.nbytes} bytes")
        if self.kind == "pickle" and (self.dtype != "uint8" or self.shape != [self.nbytes]):
            raise ValueError(f"{self.path}: a pickle entry is a flat uint8 blob")
        return self


_WORD = 2**63


class RankPart(_Frozen):
    format: Literal["aiosnap-rank-part"] = "aiosnap-rank-part"
    step: int = Field(ge=0, lt=10**20)
    save_id: str
    rank: int = Field(ge=0, lt=2**31)
    world_size: int = Field(ge=1, lt=2**31)
    main_entries: int = Field(ge=0, lt=_MAX_INT)
    objects: list[DataObject]
    written: list[WrittenRecord]
    checksums: list[ChecksumRecord] = []
    local: RankLocalRecord
    table_of: int = Field(ge=0, lt=2**31)
    """The rank whose table ``written`` numbers entries in: the lowest rank of this one's class."""
    class_digest: str = Field(pattern=r"^[0-9a-f]{32}$")
    buckets: list[int] = Field(min_length=BUCKETS, max_length=BUCKETS)
    table: list[TableEntry] | None = None
    """This class's table: in the part of its lowest rank (but the coordinator's, which it has)."""
    tree: Any = None
    references: list[DataObject] | None = None
    """Objects of earlier saves this rank wrote, which its ranges name (an incremental save)."""
    digests: list[StoredDigest] | None = None
    """The xxh3-128 of this rank's ranges (see :attr:`Manifest.digests`)."""

    _check_save_id = field_validator("save_id")(check_save_id)

    @model_validator(mode="after")
    def _consistent(self) -> RankPart:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} >= world size {self.world_size}")
        if self.table_of > self.rank:
            raise ValueError(f"the table of rank {self.table_of}: a class's table is its lowest rank's")
        if any(not -_WORD <= b < _WORD for b in self.buckets):
            raise ValueError("bucket digests must be 64-bit words")
        leads = self.table_of == self.rank and self.rank != 0
        if leads != (self.table is not None) or (self.table is None) != (self.tree is None):
            raise ValueError("the lowest rank of a class (but rank 0) ships its table and tree, the others do not")
        if self.table is not None:
            if len(self.table) != self.main_entries:
                raise ValueError(f"a table of {len(self.table)} entries for {self.main_entries} main entries")
            if check_tree(self.tree, [e.kind for e in self.table]) != len(self.local.values):
                raise ValueError(f"the tree's rank-local values are not the {len(self.local.values)} this rank holds")
        folder = object_prefix(self.step, self.save_id, self.rank) + "/"
        names = set()
        for obj in self.objects:
            if not obj.name.startswith(folder) or obj.rank != self.rank:
                raise ValueError(f"object {obj.name!r} is not in rank {self.rank}'s folder {folder!r}")
            names.add(obj.name)
        self._check_references(names)
        seen: set[int] = set()
        for record in self.written:
            if record.entry >= self.main_entries or record.entry in seen:
                raise ValueError(f"written entry {record.entry} is out of range or listed twice")
            seen.add(record.entry)
            for r in record.ranges:
                if r.object not in names:
                    raise ValueError(f"entry {record.entry}: range names unknown object {r.object!r}")
        for checksum in self.checksums:
            if checksum.entry >= self.main_entries or checksum.entry in seen:
                raise ValueError(f"the checksum of entry {checksum.entry}: out of range, listed twice, or written")
            seen.add(checksum.entry)
        for what, ranges in [
            *((f"entry {w.entry}", w.ranges) for w in self.written),
            *((f"rank-local {e.path!r}", e.ranges) for e in self.local.entries),
        ]:
            if any(r.crc32c is None for r in ranges):  # only translated manifests, never stored, have them
                raise ValueError(f"{what}: a byte range without a crc32c")
        return self

    def _check_references(self, names: set[str]) -> None:
        """Each reference an object this rank wrote in an earlier step, listed once; added
        to ``names`` (the objects ranges may name). The merged manifest checks them again."""
        for obj in self.references or ():
            attempt = attempt_of_object(obj.name)
            if attempt is None or attempt[0] >= self.step or obj.rank != self.rank or obj.name in names:
                raise ValueError(f"reference {obj.name!r:.200} is not an earlier object of rank {self.rank}")
            names.add(obj.name)
        for name, offset, _ in self.digests or ():
            if name not in names or offset < 0:
                raise ValueError(f"digest of {name!r:.200} at {offset}: not an object of this part")

    def to_json(self) -> bytes:
        return signed_json(self)

    @classmethod
    def from_json(cls, data: bytes, where: str) -> RankPart:
        """Parse and validate; every problem is a :class:`ManifestError` naming ``where``."""
        doc = parse_json(data, where, MAX_PART_BYTES, "a rank's part")
        if not crc_matches(data, doc.pop("crc32c", None) if isinstance(doc, dict) else None):
            raise ManifestError(f"{where}: the rank's part is damaged (its crc32c does not match its bytes)")
        return validated(cls, doc, where, "rank part")


def spec_table(spec: SaveSpec, *, trusted: bool = False) -> list[TableEntry]:
    """The main entries of ``spec`` as a part ships them (DTensor boxes by global shape);
    ``trusted``: the coordinator's own plan, taken without validation."""
    assert spec.distributed is not None
    boxes = {s.entry: s for s in spec.distributed.shards}
    make = TableEntry.model_construct if trusted else TableEntry
    found = []
    for index, e in enumerate(spec.entries[: spec.distributed.main_entries]):
        box = boxes.get(index)
        found.append(make(
            path=e.path, kind=e.kind, dtype=e.dtype,  # type: ignore[arg-type]
            shape=list(e.shape if box is None else box.global_shape),
            stride=list(e.stride), device=e.device, nbytes=e.nbytes, mesh=None if box is None else box.mesh,
        ))  # fmt: skip
    return found


def _ranges(spec: SaveSpec, crcs: Checksums, landings: Sequence[Landing] | None) -> dict[int, list[ByteRange]]:
    found: dict[int, list[ByteRange]] = {}
    for index, chunk in enumerate(spec.chunks):
        for at, piece in enumerate(chunk.pieces):
            if landings is None:
                name, offset, crc = chunk.object_name, piece.dst_offset, crcs[(chunk.object_name, piece.dst_offset)]
            else:
                placed = landings[index].pieces[at]
                name, offset, crc = placed.object, placed.offset, placed.crc32c
            found.setdefault(piece.entry, []).append(
                ByteRange(object=name, offset=offset, nbytes=piece.nbytes, crc32c=crc)
            )
    return found


def _record(spec: SaveSpec, index: int, ranges: list[ByteRange]) -> EntryRecord:
    e = spec.entries[index]
    return EntryRecord(
        path=e.path, kind=e.kind, dtype=e.dtype, shape=list(e.shape), stride=list(e.stride),  # type: ignore[arg-type]
        device=e.device, nbytes=e.nbytes, ranges=ranges,
    )  # fmt: skip


def build_part(spec: SaveSpec, crcs: Checksums, landings: Sequence[Landing] | None = None) -> RankPart:
    """This rank's part of the save ``spec``, every range's crc32c from ``crcs``; of an
    incremental save, each piece where ``landings`` (one per chunk) says it landed."""
    dist = spec.distributed
    if dist is None:
        raise ValueError("not a multi-rank save")
    if landings is not None and len(landings) != len(spec.chunks):
        raise ValueError(f"{len(landings)} landings for {len(spec.chunks)} chunks")
    ranges = _ranges(spec, crcs, landings)
    boxes = {s.entry: s for s in dist.shards}
    written = [
        WrittenRecord(
            entry=i,
            shape=list(spec.entries[i].shape),
            offsets=list(boxes[i].offsets) if i in boxes else None,
            ranges=ranges.get(i, []),
        )
        for i in dist.written
    ]
    main = dist.main_entries
    local = RankLocalRecord(
        values=[shift_entry_ids(v, -main) for v in dist.local_values],
        entries=[_record(spec, i, ranges.get(i, [])) for i in range(main, len(spec.entries))],
    )
    leads = dist.table_of == spec.rank and spec.rank != dist.coordinator
    return RankPart(
        step=spec.step,
        save_id=spec.save_id,
        rank=spec.rank,
        world_size=spec.world_size,
        main_entries=main,
        objects=_objects(spec, landings),
        written=written,
        checksums=[ChecksumRecord(entry=i, crc32c=crc) for i, crc in dist.checksums],
        local=local,
        table_of=dist.table_of,
        class_digest=dist.class_digest or "0" * 32,
        buckets=list(dist.buckets or (0,) * BUCKETS),
        table=spec_table(spec) if leads else None,
        tree=spec.tree if leads else None,
        **_incremental(landings),
    )


def _objects(spec: SaveSpec, landings: Sequence[Landing] | None) -> list[DataObject]:
    if landings is None:
        return [DataObject(name=c.object_name, rank=spec.rank, nbytes=c.nbytes) for c in spec.chunks]
    return [
        DataObject(name=c.object_name, rank=spec.rank, nbytes=landing.stored)
        for c, landing in zip(spec.chunks, landings, strict=True)
        if landing.stored
    ]


def _incremental(landings: Sequence[Landing] | None) -> dict[str, Any]:
    """The references and digests fields of an incremental part (none otherwise)."""
    if landings is None:
        return {}
    references = sorted({r for landing in landings for r in landing.references})
    digests = [(p.object, p.offset, p.digest) for landing in landings for p in landing.pieces if p.digest is not None]
    return {
        "references": [DataObject(name=n, rank=rank, nbytes=size) for n, rank, size in references] or None,
        "digests": digests or None,
    }
