"""Where an upload put each piece of a chunk, and the ranges a later save may reuse.

With incremental saves (``upload.dedup``) the stored layout is decided by the upload, not
by the plan: a piece whose captured bytes equal a range of the base step (the latest
committed step this save's transfer side knows) is not written again; the new manifest
names that range instead, and the chunk's own object holds only the new pieces, packed.
:class:`Landing` is what the upload of one chunk reports (and what the spool journal keeps
for a resume); :class:`BaseRanges` indexes a committed manifest's ranges by (size, digest).
Plain data, no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .manifest import ByteRange, DataObject, Manifest, version_for

__all__ = ["BaseRanges", "Landing", "Placed", "Reference", "Reuse", "landed_manifest"]


@dataclass(frozen=True, slots=True)
class Placed:
    """One piece as stored: ``object`` (the chunk's own, or an earlier step's) at ``offset``,
    the crc32c and the xxh3-128 digest (hex; None when not computed) of its bytes; when
    compressed (zstd), the ``stored`` size and crc32c of its frame and its byte shuffle."""

    object: str
    offset: int
    crc32c: int
    digest: str | None
    stored: int | None = None
    stored_crc32c: int | None = None
    shuffle: int | None = None

    def byte_range(self, nbytes: int) -> ByteRange:
        """The manifest's range of this piece of ``nbytes`` raw bytes."""
        return ByteRange.model_construct(
            object=self.object, offset=self.offset, nbytes=nbytes, crc32c=self.crc32c,
            codec=None if self.stored is None else "zstd", stored=self.stored, stored_crc32c=self.stored_crc32c,
            shuffle=self.shuffle,
        )  # fmt: skip

    @property
    def codec(self) -> list[int | None] | None:
        """The compression fields as a journal keeps them (None: stored raw)."""
        return None if self.stored is None else [self.stored, self.stored_crc32c, self.shuffle]


Reference = tuple[str, int, int]
"""An earlier step's object a landing names: (name, rank, whole stored size)."""


@dataclass(frozen=True, slots=True)
class Landing:
    """How one chunk landed: ``stored`` bytes of its own object were written (0: none, every
    piece is an earlier step's range), each piece where ``pieces`` says (in the chunk's piece
    order), naming ``references`` of earlier steps."""

    stored: int
    pieces: tuple[Placed, ...]
    references: tuple[Reference, ...] = ()
    incremental: bool = False
    """Landed by an incremental save (its places and digests go into the manifest and the
    journal); False: every piece where the plan put it, as without ``upload.dedup``."""

    @property
    def crcs(self) -> list[int]:
        """The crc32c of each piece (what a load checks)."""
        return [p.crc32c for p in self.pieces]

    def record(self) -> dict[str, Any]:
        """The JSON-able fields a spool journal's ``landed`` record keeps."""
        if not self.incremental:
            return {"pieces": self.crcs}
        record = {
            "pieces": self.crcs,
            "stored": self.stored,
            "placed": [[p.object, p.offset, p.digest] for p in self.pieces],
            "references": [list(r) for r in self.references],
        }
        if any(p.stored is not None for p in self.pieces):
            record["codecs"] = [p.codec for p in self.pieces]
        return record


@dataclass
class BaseRanges:
    """The ranges of committed step ``step`` (save ``save_id``) one rank may reuse, by
    (size, digest): the step's own objects and its references alike (flattened: a save
    names where the bytes are, never a step that names them)."""

    step: int
    save_id: str
    objects: dict[str, DataObject]
    by_content: dict[tuple[int, str], list[Placed]] = field(default_factory=dict)

    @classmethod
    def of(cls, manifest: Manifest, rank: int) -> BaseRanges:
        """The reusable ranges of ``manifest`` (validated) written by ``rank``."""
        objects = {o.name: o for o in manifest.stored_objects() if o.rank == rank}
        digests = {(name, offset): hex_ for name, offset, hex_ in manifest.digests or ()}
        base = cls(manifest.step, manifest.save_id, objects)
        ranges = [r for _, r in manifest.whole_ranges()]
        ranges += [
            ByteRange.model_construct(object=o, offset=at, nbytes=n, crc32c=c, codec=None, stored=None,
                                      stored_crc32c=None, shuffle=None)
            for entry in manifest.entries for _, _, shard in entry.shards or () for o, at, n, c in shard
        ]  # fmt: skip
        for r in ranges:
            digest = digests.get((r.object, r.offset))
            if digest is None or r.object not in objects or r.crc32c is None:
                continue
            placed = Placed(r.object, r.offset, r.crc32c, digest, r.stored, r.stored_crc32c, r.shuffle)
            base.by_content.setdefault((r.nbytes, digest), []).append(placed)
        return base

    @property
    def names(self) -> list[str]:
        return sorted(self.objects)


class Reuse:
    """One save's use of a base: each base range is named at most once (two pieces of equal
    bytes: the second is written, since no stored byte may be loaded twice). Transfer loop."""

    def __init__(self, base: BaseRanges, *, compressed: bool = True) -> None:
        self.base = base
        self.compressed = compressed
        """Whether a compressed base range may be named (not by a multi-rank save, whose
        shards cannot say so)."""
        self._used: set[tuple[str, int]] = set()

    def candidates(self, nbytes: int, digest: str, crc32c: int) -> list[Placed]:
        """The base ranges of ``nbytes`` bytes with ``digest`` and ``crc32c`` this save has
        not named yet (whether their stored bytes still hold them is the caller's to check)."""
        return [
            placed
            for placed in self.base.by_content.get((nbytes, digest), ())
            if (placed.object, placed.offset) not in self._used
            and placed.crc32c == crc32c
            and (self.compressed or placed.stored is None)
        ]

    def claim(self, placed: Placed) -> tuple[Placed, Reference] | None:
        """Name ``placed`` (one of :meth:`candidates`), and the object it lies in; None when
        this save named it meanwhile."""
        key = (placed.object, placed.offset)
        if key in self._used:
            return None
        self._used.add(key)
        obj = self.base.objects[placed.object]
        return placed, (obj.name, obj.rank, obj.nbytes)


def landed_manifest(
    manifest: Manifest, plan_chunks: Sequence[tuple[str, list[int]]], landings: Sequence[Landing]
) -> Manifest:
    """``manifest`` (built from the plan: every piece at its planned offset of its planned
    object) with each piece where its upload put it: ``plan_chunks`` gives each chunk's
    object name and its pieces' planned offsets, ``landings`` (same order) how each landed.
    The objects become those written (at their stored sizes; a chunk that wrote nothing has
    none), the references those named, every range carries its digest. Built, not
    validated (see :func:`~aiosnap.format.manifest.checked_json`)."""
    where: dict[tuple[str, int], Placed] = {}
    stored: dict[str, int] = {}
    references: dict[str, Reference] = {}
    for (name, offsets), landing in zip(plan_chunks, landings, strict=True):
        if len(offsets) != len(landing.pieces):
            raise ValueError(f"object {name!r:.80}: {len(landing.pieces)} pieces landed, the plan has {len(offsets)}")
        if landing.stored:
            stored[name] = landing.stored
        where.update(zip(((name, offset) for offset in offsets), landing.pieces, strict=True))
        references.update((r[0], r) for r in landing.references)
    digests: list[tuple[str, int, str]] = []

    def moved(ranges: list[ByteRange]) -> list[ByteRange]:
        out = []
        for r in ranges:
            placed = where[(r.object, r.offset)]
            out.append(placed.byte_range(r.nbytes))
            if placed.digest is not None:
                digests.append((placed.object, placed.offset, placed.digest))
        return out

    entries = [e.model_copy(update={"ranges": moved(e.ranges)}) for e in manifest.entries]
    objects = [o.model_copy(update={"nbytes": stored[o.name]}) for o in manifest.objects if o.name in stored]
    refs = [DataObject.model_construct(name=n, rank=rank, nbytes=size) for n, rank, size in sorted(references.values())]
    update: dict[str, Any] = {
        "entries": entries, "objects": objects, "references": refs or None, "digests": digests or None,
    }  # fmt: skip
    result = manifest.model_copy(update=update)
    return result.model_copy(update={"format_version": version_for(result)})
