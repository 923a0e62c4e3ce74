"""A rank's part of a multi-rank save, and the coordinator's merge of all parts into the
step's manifest. Pure code, no I/O.

Each rank writes its part (``<step>/<save id>/rank-<r>.part.json``) after its data objects:
the shared entries it wrote (a replicated entry whole, a DTensor's shard with its box) and
its rank-local values. The coordinator reads every part, checks it as untrusted input
(strict types, every object inside that rank's own folder, a crc32c of the document), and
merges them with its own plan: each replicated entry written by exactly one rank, each
sharded entry's shards tiling it, one rank-local record per rank. The result is validated
like any manifest read back before it is written.
"""

from __future__ import annotations

import math
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..core.gcpause import gc_paused
from ..core.names import attempt_prefix, check_save_id, object_prefix
from ..errors import ManifestError
from .dtypes import dtype_itemsize
from .manifest import (
    FORMAT_VERSION,
    ByteRange,
    Checksums,
    DataObject,
    EntryRecord,
    Manifest,
    RankLocalRecord,
    ShardRecord,
    StoredShard,
    crc_matches,
    parse_json,
    signed_json,
    validated,
)
from .spec import SaveSpec
from .tree import shift_entry_ids

__all__ = ["RankPart", "WrittenRecord", "build_part", "failed_name", "merge_parts", "part_name"]

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


class RankPart(_Frozen):
    format: Literal["aiosnap-rank-part"] = "aiosnap-rank-part"
    step: int = Field(ge=0, lt=10**20)
    save_id: str
    rank: int = Field(ge=0, lt=2**31)
    world_size: int = Field(ge=1, lt=2**31)
    main_entries: int = Field(ge=0, lt=_MAX_INT)
    objects: list[DataObject]
    written: list[WrittenRecord]
    local: RankLocalRecord

    _check_save_id = field_validator("save_id")(check_save_id)

    @model_validator(mode="after")
    def _consistent(self) -> RankPart:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} >= world size {self.world_size}")
        folder = object_prefix(self.step, self.save_id, self.rank) + "/"
        names = set()
        for obj in self.objects:
            if not obj.name.startswith(folder) or obj.rank != self.rank:
                raise ValueError(f"object {obj.name!r} is not in rank {self.rank}'s folder {folder!r}")
            names.add(obj.name)
        seen: set[int] = set()
        for record in self.written:
            if record.entry >= self.main_entries or record.entry in seen:
                raise ValueError(f"written entry {record.entry} is out of range or listed twice")
            seen.add(record.entry)
            for r in record.ranges:
                if r.object not in names:
                    raise ValueError(f"entry {record.entry}: range names unknown object {r.object!r}")
        return self

    def to_json(self) -> bytes:
        return signed_json(self)

    @classmethod
    def from_json(cls, data: bytes, where: str) -> RankPart:
        """Parse and validate; every problem is a :class:`ManifestError` naming ``where``."""
        doc = parse_json(data, where, MAX_PART_BYTES, "a rank's part")
        if not crc_matches(data, doc.pop("crc32c", None) if isinstance(doc, dict) else None):
            raise ManifestError(f"{where}: the rank's part is damaged (its crc32c does not match its bytes)")
        return validated(cls, doc, where, "rank part")


def _ranges(spec: SaveSpec, crcs: Checksums) -> dict[int, list[ByteRange]]:
    found: dict[int, list[ByteRange]] = {}
    for chunk in spec.chunks:
        for piece in chunk.pieces:
            crc = crcs[(chunk.object_name, piece.dst_offset)]
            found.setdefault(piece.entry, []).append(
                ByteRange(object=chunk.object_name, offset=piece.dst_offset, nbytes=piece.nbytes, crc32c=crc)
            )
    return found


def _record(spec: SaveSpec, index: int, ranges: list[ByteRange]) -> EntryRecord:
    e = spec.entries[index]
    return EntryRecord(
        path=e.path, kind=e.kind, dtype=e.dtype, shape=list(e.shape), stride=list(e.stride),  # type: ignore[arg-type]
        device=e.device, nbytes=e.nbytes, ranges=ranges,
    )  # fmt: skip


def build_part(spec: SaveSpec, crcs: Checksums) -> RankPart:
    """This rank's part of the save ``spec``, every range's crc32c from ``crcs``."""
    dist = spec.distributed
    if dist is None:
        raise ValueError("not a multi-rank save")
    ranges = _ranges(spec, crcs)
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
    return RankPart(
        step=spec.step,
        save_id=spec.save_id,
        rank=spec.rank,
        world_size=spec.world_size,
        main_entries=main,
        objects=[DataObject(name=c.object_name, rank=spec.rank, nbytes=c.nbytes) for c in spec.chunks],
        written=written,
        local=local,
    )


def merge_parts(spec: SaveSpec, parts: dict[int, RankPart]) -> Manifest:
    """The step's manifest from the coordinator's plan ``spec`` and every rank's part.
    ValueError (naming the rank) when the parts do not make one checkpoint. Built with the
    collector paused, as a one-rank save's (:func:`~aiosnap.format.manifest.build_manifest`)."""
    with gc_paused():
        return _merged(spec, parts)


def _merged(spec: SaveSpec, parts: dict[int, RankPart]) -> Manifest:
    dist = spec.distributed
    if dist is None:
        raise ValueError("not a multi-rank save")
    if sorted(parts) != list(range(spec.world_size)):
        raise ValueError(f"parts of ranks {sorted(parts)[:8]} for a world of {spec.world_size}")
    main = dist.main_entries
    globals_ = {s.entry: s.global_shape for s in dist.shards}
    whole: dict[int, WrittenRecord] = {}
    writers: dict[int, int] = {}
    shards: dict[int, list[StoredShard]] = {i: [] for i in globals_}
    for rank, part in sorted(parts.items()):
        if (part.step, part.save_id, part.rank, part.world_size, part.main_entries) != (
            spec.step, spec.save_id, rank, spec.world_size, main,
        ):  # fmt: skip
            raise ValueError(f"rank {rank}'s part is of another save, rank or world")
        for record in part.written:
            if record.entry in globals_:
                if record.offsets is None:
                    raise ValueError(f"rank {rank}: entry {record.entry} is sharded but written whole")
                shards[record.entry].append(ShardRecord(record.offsets, record.shape, record.ranges).stored())
            elif record.offsets is not None or record.entry in writers:
                raise ValueError(
                    f"rank {rank}: entry {record.entry} written twice (also by rank {writers.get(record.entry)})"
                )
            else:
                whole[record.entry] = record
                writers[record.entry] = rank
    entries: list[EntryRecord] = []
    for index, e in enumerate(spec.entries[:main]):
        if index in globals_:
            shape = list(globals_[index])
            entries.append(EntryRecord(
                path=e.path, kind="sharded", dtype=e.dtype, shape=shape, stride=_contiguous(shape),
                device=e.device, nbytes=dtype_itemsize(e.dtype) * math.prod(shape), ranges=[], shards=shards[index],
            ))  # fmt: skip
            continue
        found = whole.get(index)
        if found is None:
            raise ValueError(f"entry {index} ({e.path!r}) was written by no rank")
        nbytes = sum(r.nbytes for r in found.ranges)
        shape = list(e.shape) if e.kind == "tensor" else [nbytes]
        if e.kind == "tensor" and found.shape != shape:
            raise ValueError(f"rank {writers[index]}: {e.path!r} has shape {found.shape}, not {shape}")
        entries.append(EntryRecord(
            path=e.path, kind=e.kind, dtype=e.dtype, shape=shape,  # type: ignore[arg-type]
            stride=list(e.stride) if e.kind == "tensor" else [1], device=e.device, nbytes=nbytes, ranges=found.ranges,
        ))  # fmt: skip
    local = [parts[r].local for r in range(spec.world_size)] if dist.local_values else None
    return Manifest(
        format_version=FORMAT_VERSION,
        step=spec.step,
        save_id=spec.save_id,
        created_at=time.time(),
        world_size=spec.world_size,
        objects=[o for r in range(spec.world_size) for o in parts[r].objects],
        entries=entries,
        tree=spec.tree,
        metadata=spec.metadata,
        rank_local=local,
    )


def _contiguous(shape: list[int]) -> list[int]:
    stride, step = [], 1
    for d in reversed(shape):
        stride.append(step)
        step *= max(d, 1)
    return stride[::-1]
