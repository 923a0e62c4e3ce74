"""The manifest: a step's commit marker, written last, JSON (never pickle), versioned.

It maps the state's tree to byte ranges of data objects, each with a crc32c. A manifest
is read back from storage other people may write, so :meth:`Manifest.from_json` checks
all of it before anything acts on it: strict types (``true`` is not a number), the format
version, every object named inside the save's own attempt folder, every byte range inside
its object, shapes that match byte counts, and the tree (see :mod:`aiosnap.format.tree`). Every
problem is a :class:`~aiosnap.errors.ManifestError` naming the file.

*Unverified ranges.* A checkpoint of another format (a DCP folder, a ``torch.save`` file,
safetensors) is presented to the load machinery as a manifest translated from its own
metadata (see :mod:`aiosnap.interop`). Such a format may record no checksum for some bytes:
their range has ``crc32c`` None, and it is read without a check. Only a *translated*
manifest, one whose ``foreign`` names the format it came from, may hold such ranges; it is
built in memory from the foreign metadata (:meth:`Manifest.translated`) and never stored:
:meth:`Manifest.to_json` refuses it, and a stored document naming ``foreign`` is refused by
:meth:`Manifest.from_document`. So aiosnap's own manifests (every commit, every copy) keep a
crc32c on every range.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator
from pydantic_core import PydanticSerializationError

from ..core.checksums import crc32c_of
from ..core.gcpause import gc_paused
from ..core.names import (
    MANIFEST_FILE,
    STEP_LIMIT,
    attempt_of_object,
    attempt_prefix,
    check_object_name,
    check_save_id,
    manifest_name,
)
from ..errors import ManifestError
from .dtypes import dtype_itemsize
from .spec import SaveSpec
from .tiling import check_tiling
from .tree import check_tree
from .values import MAX_NDIM, check_metadata, json_int

__all__ = [
    "COMPRESSED_VERSION",
    "DIGEST_HEX",
    "FORMAT_VERSION",
    "INCREMENTAL_VERSION",
    "MANIFEST_FILE",
    "MAX_MANIFEST_BYTES",
    "MULTI_RANK_VERSION",
    "PLAIN_VERSION",
    "ByteRange",
    "Checksums",
    "DataObject",
    "EntryRecord",
    "Manifest",
    "RankLocalRecord",
    "ShardRecord",
    "Span",
    "StoredDigest",
    "StoredShard",
    "build_manifest",
    "checked_json",
    "crc_matches",
    "describe_validation",
    "manifest_name",
    "signed_json",
    "version_for",
]

FORMAT_VERSION = 5
"""Read by this aiosnap: 1; 2 added a crc32c of the manifest's own bytes; 3 added multi-rank
checkpoints (sharded entries, rank-local values); 4 added incremental saves (``references``
to earlier saves' objects, ``digests`` of ranges); 5 compressed ranges (``codec``). A
manifest is written with the oldest version that holds it (:data:`PLAIN_VERSION` unless it
has multi-rank parts or the fields of later versions; see :func:`version_for`), so that
older readers keep reading what they can and refuse the rest by its version."""
PLAIN_VERSION = 2
MULTI_RANK_VERSION = 3
INCREMENTAL_VERSION = 4
COMPRESSED_VERSION = 5
DIGEST_HEX = 32
"""A range's content digest: xxh3-128, as 32 lower-case hex digits."""
_DIGEST = re.compile(r"[0-9a-f]{32}")
_CRC_FIELD = b',"crc32c":'
MAX_MANIFEST_BYTES = 128 * 1024**2
"""A manifest larger than this is refused unread (a hostile file must not exhaust memory)."""
_MAX_INT = 2**63


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class Span(NamedTuple):
    """A stored byte range, whatever holds it (see :meth:`Manifest.all_ranges`): of a
    compressed range, its frame (stored size, the frame's crc32c)."""

    object: str
    offset: int
    nbytes: int
    crc32c: int | None
    """None: an unverified range of a translated manifest."""


class ByteRange(_Frozen):
    """``nbytes`` at ``offset`` of data object ``object``. The name is checked where the
    range is used: it must be one of its manifest's (or rank part's) objects, whose names
    are checked (once per object, not once per range: 8,192 ranks' shards are 10^5 ranges).

    ``crc32c`` None is an *unverified* range: only manifests translated from a foreign
    format that records no checksum (safetensors) have them; aiosnap's own commit path
    refuses a manifest with one (:meth:`Manifest.has_unverified_ranges`)."""

    object: str
    offset: int = Field(ge=0, lt=_MAX_INT)
    nbytes: int = Field(gt=0, lt=_MAX_INT)
    crc32c: int | None = Field(default=None, ge=0, lt=2**32)
    """None only in a manifest translated from a foreign format (see the module docstring)."""
    codec: Literal["zstd"] | None = None
    """A compressed range (format version 5): ``stored`` bytes at ``offset`` hold a zstd
    frame of the ``nbytes`` raw bytes (``crc32c`` is theirs, ``stored_crc32c`` the frame's),
    byte-shuffled by ``shuffle`` (the dtype's item size) before compression when set."""
    stored: int | None = Field(default=None, gt=0, lt=_MAX_INT)
    stored_crc32c: int | None = Field(default=None, ge=0, lt=2**32)
    shuffle: int | None = Field(default=None, ge=2, le=16)

    @model_validator(mode="after")
    def _codec_fields(self) -> ByteRange:
        if self.codec is None:
            if self.stored is not None or self.stored_crc32c is not None or self.shuffle is not None:
                raise ValueError(f"a range of {self.object!r:.200} has compression fields but no codec")
            return self
        if self.stored is None or self.stored_crc32c is None or self.crc32c is None:
            raise ValueError(f"a compressed range of {self.object!r:.200} needs stored, stored_crc32c and crc32c")
        if self.stored >= self.nbytes:
            raise ValueError(f"a compressed range of {self.object!r:.200} is not smaller than its {self.nbytes} bytes")
        if self.shuffle is not None and self.nbytes % self.shuffle:
            raise ValueError(
                f"a range of {self.nbytes} bytes of {self.object!r:.200} cannot be shuffled by {self.shuffle}"
            )
        return self

    @property
    def extent(self) -> int:
        """The bytes it takes in its object (``stored`` for a compressed range)."""
        return self.nbytes if self.stored is None else self.stored

    def span(self) -> Span:
        """Where its bytes are stored and their crc32c (of the frame, when compressed)."""
        if self.codec is None:
            return Span(self.object, self.offset, self.nbytes, self.crc32c)
        return Span(self.object, self.offset, self.extent, self.stored_crc32c)


class DataObject(_Frozen):
    name: str
    rank: int = Field(ge=0, lt=2**31)
    nbytes: int = Field(ge=0, lt=_MAX_INT)

    _check_name = field_validator("name")(check_object_name)


_S = Strict()
StoredDigest = Annotated[tuple[Annotated[str, _S], Annotated[int, _S], Annotated[str, _S]], Strict(False)]
"""``[object, offset, digest]``: the xxh3-128 of the range at ``offset`` of ``object``."""
_StoredRange = Annotated[
    tuple[Annotated[str, _S], Annotated[int, _S], Annotated[int, _S], Annotated[int, _S] | None], Strict(False)
]
StoredShard = Annotated[
    tuple[Annotated[list[int], _S], Annotated[list[int], _S], Annotated[list[_StoredRange], _S]], Strict(False)
]  # arrays for tuples (JSON has no tuples), every item strictly typed
"""A stored shard as the manifest keeps it: ``[offsets, shape, [[object, offset, nbytes,
crc32c], ...]]``: where it sits in the global tensor and its bytes (contiguous, row-major),
written by one rank. Arrays, not objects: a job of 8,192 ranks stores 10^5 shards, which
validate several times faster this way (:class:`ShardRecord` is the view code uses)."""


@dataclass(frozen=True)
class ShardRecord:
    """A view of one :data:`StoredShard`."""

    offsets: list[int]
    shape: list[int]
    ranges: list[ByteRange]

    @classmethod
    def of(cls, stored: StoredShard) -> ShardRecord:
        offsets, shape, ranges = stored
        return cls(offsets, shape, [
            ByteRange.model_construct(object=o, offset=at, nbytes=n, crc32c=c) for o, at, n, c in ranges
        ])  # fmt: skip

    def stored(self) -> StoredShard:
        """As the manifest keeps it (a rank's shard of a save: every range has its crc32c)."""
        if any(r.crc32c is None for r in self.ranges):
            raise ValueError("a stored shard's byte ranges all carry a crc32c")
        return (self.offsets, self.shape, [(r.object, r.offset, r.nbytes, r.crc32c or 0) for r in self.ranges])


class EntryRecord(_Frozen):
    """A stored tensor or pickle (its ``ranges``), or, of kind ``sharded``, a tensor of
    global ``shape`` stored as ``shards`` that tile it (a DTensor saved by several ranks)."""

    path: str
    kind: Literal["tensor", "pickle", "sharded"]
    dtype: str
    shape: list[int]
    stride: list[int]
    device: str
    nbytes: int = Field(ge=0, lt=_MAX_INT)
    ranges: list[ByteRange]
    shards: list[StoredShard] | None = None

    def shard_records(self) -> list[ShardRecord]:
        """The stored shards (a whole entry: one shard, the whole tensor)."""
        if self.shards is not None:
            return [ShardRecord.of(s) for s in self.shards]
        return [ShardRecord([0] * len(self.shape), list(self.shape), list(self.ranges))]

    @model_validator(mode="after")
    def _consistent(self) -> EntryRecord:
        itemsize = dtype_itemsize(self.dtype)
        if (self.kind == "sharded") != (self.shards is not None):
            raise ValueError(f"{self.path}: shards belong to sharded entries, and only to them")
        if self.shards is not None:
            _check_shards(self, itemsize)
        elif sum(r.nbytes for r in self.ranges) != self.nbytes:
            raise ValueError(f"{self.path}: byte ranges do not add up to {self.nbytes}")
        if any(not 0 <= d < _MAX_INT for d in self.shape) or len(self.shape) > MAX_NDIM:
            raise ValueError(f"{self.path}: invalid shape {self.shape}")
        if len(self.stride) != len(self.shape):
            raise ValueError(f"{self.path}: stride {self.stride} does not match shape {self.shape}")
        expected = math.prod(self.shape) * itemsize
        if expected != self.nbytes:
            raise ValueError(f"{self.path}: shape {self.shape} of {self.dtype} is {expected} bytes, not {self.nbytes}")
        if self.kind == "pickle" and (self.dtype != "uint8" or len(self.shape) != 1):
            raise ValueError(f"{self.path}: a pickle entry is a flat uint8 blob")
        return self


def _check_shards(entry: EntryRecord, itemsize: int) -> None:
    if entry.ranges:
        raise ValueError(f"{entry.path}: a sharded entry's bytes are in its shards")
    for offsets, shape, ranges in entry.shards or ():
        values = offsets + shape
        if values and not (min(values) >= 0 and max(values) < _MAX_INT):
            raise ValueError(f"{entry.path}: invalid shard at {offsets} of shape {shape}")
        nbytes = math.prod(shape) * itemsize
        total = 0
        for _, offset, size, crc in ranges:  # what ByteRange checks for whole entries
            if not (0 <= offset < _MAX_INT and 0 < size < _MAX_INT and (crc is None or 0 <= crc < 2**32)):
                raise ValueError(f"{entry.path}: invalid byte range in the shard at {offsets}")
            total += size
        if total != nbytes:
            raise ValueError(f"{entry.path}: the shard at {offsets} is {nbytes} bytes, its ranges are not")
    try:
        check_tiling(entry.shape, [(tuple(s[0]), tuple(s[1])) for s in entry.shards or ()])
    except ValueError as exc:
        raise ValueError(f"{entry.path}: {exc}") from None


class RankLocalRecord(_Frozen):
    """What one rank saved of the paths declared ``rank_local``: one tree per
    ``{"t": "rank_local", "slot": N}`` node of the manifest's tree (in slot order), whose
    tensor and pickle nodes name this record's own ``entries``."""

    values: list[Any]
    entries: list[EntryRecord]


class Manifest(_Frozen):
    format: Literal["aiosnap"] = "aiosnap"
    format_version: int
    step: int = Field(ge=0, lt=STEP_LIMIT)
    save_id: str
    created_at: float
    world_size: int = Field(ge=1, lt=2**31)
    objects: list[DataObject]
    entries: list[EntryRecord]
    tree: Any
    metadata: dict[str, Any]
    rank_local: list[RankLocalRecord] | None = None
    """One record per rank (``world_size`` of them) when the save declared rank-local paths."""
    foreign: Literal["dcp", "torch", "safetensors"] | None = None
    """The format a translated manifest was made from (its ranges may lack a crc32c);
    None for aiosnap's own manifests, which are the only ones ever stored."""
    references: list[DataObject] | None = None
    """Objects that earlier saves of this root wrote and this step's ranges name (an
    incremental save: bytes equal to ones already stored are not written again). Each
    lies in the attempt folder of an *earlier* step (never this save's own folder), is
    listed once, and is kept in storage while any kept manifest names it (see
    :mod:`aiosnap.catalog`); its ``nbytes`` is its whole stored size, checked at load."""
    digests: list[StoredDigest] | None = None
    """The content digest (xxh3-128) of byte ranges, ``[object, offset, hex]``: what a
    later incremental save compares its captured bytes with. Each names a range of this
    manifest, at most once."""

    _check_save_id = field_validator("save_id")(check_save_id)

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        folder = attempt_prefix(self.step, self.save_id) + "/"
        sizes: dict[str, int] = {}
        for obj in self.objects:
            if not obj.name.startswith(folder):
                raise ValueError(f"object {obj.name!r} lies outside this save's folder {folder!r}")
            if obj.rank >= self.world_size:
                raise ValueError(f"object {obj.name!r}: rank {obj.rank} >= world size {self.world_size}")
            if sizes.setdefault(obj.name, obj.nbytes) != obj.nbytes:
                raise ValueError(f"object {obj.name!r} is listed twice with different sizes")
        self._check_references(folder, sizes)
        spans: dict[str, list[tuple[int, int]]] = {}
        for entry, r in self.all_ranges():
            if r.crc32c is None and self.foreign is None:
                raise ValueError(f"{entry.path}: a byte range without a crc32c (only translated manifests have them)")
            if r.object not in sizes:
                raise ValueError(f"{entry.path}: range names unknown object {r.object!r}")
            if r.offset + r.nbytes > sizes[r.object]:
                raise ValueError(f"{entry.path}: range runs past the end of {r.object!r}")
            spans.setdefault(r.object, []).append((r.offset, r.offset + r.nbytes))
        for name, found in spans.items():  # no byte stored once may be loaded twice
            found.sort()
            for (_, end), (start, _) in itertools.pairwise(found):
                if start < end:
                    raise ValueError(f"byte ranges overlap in object {name!r}")
        slots = check_tree(self.tree, [e.kind for e in self.entries])
        try:
            check_metadata(self.metadata)
        except ValueError as exc:
            raise ValueError(f"metadata: {exc}") from None
        if self.rank_local is not None and len(self.rank_local) != self.world_size:
            raise ValueError(f"rank-local values of {len(self.rank_local)} ranks in a world of {self.world_size}")
        if slots and self.rank_local is None:
            raise ValueError(f"the tree has {slots} rank-local value(s) but no rank holds any")
        for rank, part in enumerate(self.rank_local or ()):
            if len(part.values) != slots:
                raise ValueError(f"rank {rank}: {len(part.values)} rank-local values, the tree has {slots}")
            kinds = [e.kind for e in part.entries]
            if "sharded" in kinds:
                raise ValueError(f"rank {rank}: a rank-local value cannot be sharded")
            for value in part.values:
                if check_tree(value, kinds, local=True):
                    raise ValueError(f"rank {rank}: rank-local values cannot nest")
        if self.format_version < 3 and (slots or any(e.kind == "sharded" for e in self.entries)):
            raise ValueError(f"format version {self.format_version} has no multi-rank parts")
        if self.format_version < COMPRESSED_VERSION and self.is_compressed():
            raise ValueError(f"format version {self.format_version} has no compressed ranges")
        self._check_digests(spans)
        return self

    def _check_references(self, folder: str, sizes: dict[str, int]) -> None:
        """Referenced objects: each in an earlier step's attempt folder, listed once (added
        to ``sizes``, the objects ranges may name)."""
        if self.references is None:
            return
        if self.format_version < INCREMENTAL_VERSION:
            raise ValueError(f"format version {self.format_version} has no references to earlier saves")
        for obj in self.references:
            attempt = attempt_of_object(obj.name)
            if attempt is None or obj.name.startswith(folder):
                raise ValueError(f"reference {obj.name!r} is not an object of another save of this root")
            if attempt[0] >= self.step:
                raise ValueError(f"reference {obj.name!r} names step {attempt[0]}, not one before step {self.step}")
            if obj.rank >= self.world_size:
                raise ValueError(f"reference {obj.name!r}: rank {obj.rank} >= world size {self.world_size}")
            if obj.name in sizes:
                raise ValueError(f"object {obj.name!r} is listed twice")
            sizes[obj.name] = obj.nbytes

    def _check_digests(self, spans: dict[str, list[tuple[int, int]]]) -> None:
        if self.digests is None:
            return
        if self.format_version < INCREMENTAL_VERSION:
            raise ValueError(f"format version {self.format_version} has no range digests")
        starts = {(name, start) for name, found in spans.items() for start, _ in found}
        seen: set[tuple[str, int]] = set()
        for name, offset, digest in self.digests:
            key = (name, offset)
            if key not in starts or key in seen:
                raise ValueError(f"digest of {name!r:.200} at {offset}: no such range, or listed twice")
            if not _DIGEST.fullmatch(digest):
                raise ValueError(f"digest of {name!r:.200} at {offset} is not {DIGEST_HEX} lower-case hex digits")
            seen.add(key)

    def is_compressed(self) -> bool:
        """Whether a byte range is compressed (format version 5)."""
        return any(r.codec is not None for _, r in self.whole_ranges())

    def stored_objects(self) -> list[DataObject]:
        """Every object a load of this step reads: its own, then the referenced ones."""
        return [*self.objects, *(self.references or ())]

    @property
    def own_bytes(self) -> int:
        """The bytes this step's own objects hold (what deleting it alone could free)."""
        return sum(o.nbytes for o in self.objects)

    def all_ranges(self) -> Iterator[tuple[EntryRecord, Span]]:
        """Every stored byte range with its entry: whole entries, shards, rank-local values
        (a compressed range as stored: its frame's extent and crc32c)."""
        for entry in self.entries:
            yield from ((entry, r.span()) for r in entry.ranges)
            for _, _, ranges in entry.shards or ():
                yield from ((entry, Span(*r)) for r in ranges)
        for part in self.rank_local or ():
            for entry in part.entries:
                yield from ((entry, r.span()) for r in entry.ranges)

    def whole_ranges(self) -> Iterator[tuple[EntryRecord, ByteRange]]:
        """The byte ranges of whole entries and rank-local values (the only ones that may be
        compressed), with their entry; shards are not among them."""
        for entry in self.entries:
            yield from ((entry, r) for r in entry.ranges)
        for part in self.rank_local or ():
            for entry in part.entries:
                yield from ((entry, r) for r in entry.ranges)

    @property
    def total_bytes(self) -> int:
        """The bytes of every object a load of the step reads from: its own and the
        referenced ones (a multi-rank save's unreferenced copies, alignment between ranges
        included). A copy of the step that stands alone holds this much."""
        return sum(o.nbytes for o in self.stored_objects())

    def has_unverified_ranges(self) -> bool:
        """Whether a byte range carries no crc32c (a manifest translated from a foreign
        format; never one aiosnap commits)."""
        return any(r.crc32c is None for _, r in self.all_ranges())

    @property
    def referenced_bytes(self) -> int:
        """The bytes its byte ranges name: what a load or a verify reads."""
        return sum(span.nbytes for _, span in self.all_ranges())

    def to_json(self) -> bytes:
        """The document, its last field the crc32c of every byte before that field. A
        translated manifest is never stored: ValueError."""
        if self.foreign is not None:
            raise ValueError(f"a manifest translated from {self.foreign} is not stored; write a new one with checksums")
        return signed_json(self)

    @classmethod
    def translated(cls, doc: dict[str, Any], foreign: str, where: str) -> Manifest:
        """The manifest ``doc`` (a document built in memory from a foreign format's
        metadata), marked as translated from ``foreign``: validated like any manifest, its
        ranges allowed to lack a crc32c; every problem a :class:`ManifestError`."""
        with gc_paused():
            return validated(cls, {**doc, "foreign": foreign}, where, f"manifest translated from {foreign}")

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and validate; every problem is a :class:`ManifestError` naming ``where``.
        The collector is paused meanwhile (a manifest of many entries is many objects)."""
        with gc_paused():
            return cls._from_json(data, where)

    @classmethod
    def _from_json(cls, data: bytes, where: str) -> Manifest:
        doc = parse_json(data, where, MAX_MANIFEST_BYTES, "a manifest")
        if isinstance(doc, dict) and doc.get("format") == "aiosnap":
            _check_version(doc.get("format_version"), where)  # a newer aiosnap's manifest: say so
            if doc["format_version"] >= 2 and not crc_matches(data, doc.pop("crc32c", None)):  # 1 had none
                raise ManifestError(f"{where}: the manifest is damaged (its crc32c does not match its bytes)")
        return cls.from_document(doc, where)

    @classmethod
    def from_document(cls, doc: Any, where: str) -> Manifest:
        """Validate an already parsed JSON document (a spool journal carries one, whose
        integrity the journal's own checksums cover)."""
        if not isinstance(doc, dict) or doc.get("format") != "aiosnap":
            raise ManifestError(f"{where}: not an aiosnap manifest")
        _check_version(doc.get("format_version"), where)
        if "foreign" in doc:
            raise ManifestError(
                f"{where}: a stored manifest never names a foreign format (translated ones stay in memory)"
            )
        return validated(cls, doc, where, "manifest")


def _check_version(version: Any, where: str) -> None:
    if type(version) is not int or not 1 <= version <= FORMAT_VERSION:
        raise ManifestError(
            f"{where}: format version {version!r:.40} is not supported "
            f"(this aiosnap reads 1 to {FORMAT_VERSION}; upgrade aiosnap for newer ones)"
        )


def version_for(manifest: Manifest) -> int:
    """The oldest format version that holds ``manifest``."""
    if manifest.is_compressed():
        return COMPRESSED_VERSION
    if manifest.references is not None or manifest.digests is not None:
        return INCREMENTAL_VERSION
    if manifest.rank_local is not None or any(e.kind == "sharded" for e in manifest.entries):
        return MULTI_RANK_VERSION
    return PLAIN_VERSION


def checked_json(manifest: Manifest, where: str) -> tuple[bytes, Manifest]:
    """``manifest`` as the bytes to commit, and the manifest the readers' own parser and
    validator make of them (:meth:`Manifest.from_json`: the size limit, JSON's digit limit,
    every check): bytes this returns, every reader accepts. :class:`ManifestError` naming
    ``where`` and the problem otherwise (nothing may be written then)."""
    try:
        document = manifest.to_json()
    except (PydanticSerializationError, ValueError, TypeError) as exc:
        raise ManifestError(f"{where}: cannot be written as JSON: {str(exc)[:200]}") from None
    return document, Manifest.from_json(document, where)


def signed_json(model: BaseModel) -> bytes:
    """``model`` as JSON (None fields left out) whose last field, ``crc32c``, is the crc32c
    of every byte before it: manifests and rank parts."""
    body = model.model_dump_json(exclude_none=True).encode("utf-8")
    return body[:-1] + _CRC_FIELD + b"%d}" % crc32c_of(body)


def crc_matches(data: bytes, found: Any) -> bool:
    """Whether ``found`` (the parsed ``crc32c`` field) is the crc32c of ``data``'s bytes
    before that field (see :func:`signed_json`)."""
    cut = data.rfind(_CRC_FIELD)
    return type(found) is int and cut >= 0 and crc32c_of(data[:cut] + b"}") == found


def parse_json(data: bytes, where: str, limit: int, what: str) -> Any:
    """The JSON document ``data`` (``what``, read from ``where``), at most ``limit`` bytes;
    :class:`ManifestError` otherwise."""
    if len(data) > limit:
        raise ManifestError(f"{where}: {len(data)} bytes is too large for {what}")
    try:
        return json.loads(data, parse_int=json_int)  # the same digit bound in every process
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"{where}: not valid JSON: {exc}") from exc


_Model = TypeVar("_Model", bound=BaseModel)


def validated(model: type[_Model], doc: Any, where: str, what: str) -> _Model:
    """``doc`` validated as ``model``; every problem a :class:`ManifestError` naming ``where``."""
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        raise ManifestError(f"{where}: invalid {what}: {describe_validation(exc)}") from None
    except (ValueError, TypeError, RecursionError) as exc:
        raise ManifestError(f"{where}: invalid {what}: {exc}") from None


def describe_validation(exc: ValidationError) -> str:
    """The first problems, located, without echoing input values (which may be huge)."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '/'}: {e['msg']}" for e in exc.errors()[:5])


Checksums = dict[tuple[str, int], int]
"""crc32c of each byte range, keyed by (object name, offset in the object)."""


def build_manifest(spec: SaveSpec, crcs: Checksums | None = None) -> Manifest:
    """The manifest of ``spec``, every range's crc32c taken from ``crcs`` (KeyError if one is
    missing; all 0 when ``crcs`` is None). Built, not validated: :func:`checked_json` reads
    it back as every reader would before anything acts on it (one validation per commit,
    the readers' own)."""
    with gc_paused():
        return _build_manifest(spec, crcs)


def _build_manifest(spec: SaveSpec, crcs: Checksums | None) -> Manifest:
    ranges: list[list[ByteRange]] = [[] for _ in spec.entries]
    make_range = ByteRange.model_construct
    for chunk in spec.chunks:
        for piece in chunk.pieces:
            if not 0 <= piece.entry < len(spec.entries):  # a spec read back from a journal
                raise ValueError(
                    f"object {chunk.object_name!r:.80}: a piece of entry {piece.entry}, "
                    f"but the save has {len(spec.entries)} entries"
                )
            crc = 0 if crcs is None else crcs[(chunk.object_name, piece.dst_offset)]
            ranges[piece.entry].append(
                make_range(object=chunk.object_name, offset=piece.dst_offset, nbytes=piece.nbytes, crc32c=crc)
            )
    make_entry = EntryRecord.model_construct
    entries = [
        make_entry(
            path=e.path,
            kind=e.kind,  # type: ignore[arg-type]
            dtype=e.dtype,
            shape=list(e.shape),
            stride=list(e.stride),
            device=e.device,
            nbytes=e.nbytes,
            ranges=ranges[index],
            shards=None,
        )
        for index, e in enumerate(spec.entries)
    ]
    if spec.distributed is not None:
        raise ValueError(f"step {spec.step}: a multi-rank save is committed by its coordinator, from every rank's part")
    return Manifest.model_construct(
        format="aiosnap",
        format_version=PLAIN_VERSION,
        step=spec.step,
        save_id=spec.save_id,
        created_at=time.time(),
        world_size=spec.world_size,
        objects=[DataObject.model_construct(name=c.object_name, rank=spec.rank, nbytes=c.nbytes) for c in spec.chunks],
        entries=entries,
        tree=spec.tree,
        metadata=spec.metadata,
        rank_local=None,
    )
