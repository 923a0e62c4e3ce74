"""The manifest: a step's commit marker, written last, JSON (never pickle), versioned.

It maps the state's tree to byte ranges of data objects, each with a crc32c. A manifest
is read back from storage other people may write, so :meth:`Manifest.from_json` checks
all of it before anything acts on it: strict types (``true`` is not a number), the format
version, every object named inside the save's own attempt folder, every byte range inside
its object, shapes that match byte counts, and the tree (see :mod:`aiosnap.format.tree`). Every
problem is a :class:`~aiosnap.errors.ManifestError` naming the file.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..checksums import crc32c_of
from ..errors import ManifestError
from ..names import MANIFEST_FILE, attempt_prefix, check_object_name, check_save_id, manifest_name
from .dtypes import dtype_itemsize
from .spec import SaveSpec
from .tree import check_tree

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "MAX_MANIFEST_BYTES",
    "ByteRange",
    "Checksums",
    "DataObject",
    "EntryRecord",
    "Manifest",
    "build_manifest",
    "manifest_name",
]

FORMAT_VERSION = 2
"""Written by this aiosnap: version 1 plus a crc32c of the manifest's own bytes (versions 1
and 2 are read)."""
_CRC_FIELD = b',"crc32c":'
MAX_MANIFEST_BYTES = 128 * 1024**2
"""A manifest larger than this is refused unread (a hostile file must not exhaust memory)."""
_MAX_INT = 2**63


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class ByteRange(_Frozen):
    object: str
    offset: int = Field(ge=0, lt=_MAX_INT)
    nbytes: int = Field(gt=0, lt=_MAX_INT)
    crc32c: int = Field(ge=0, lt=2**32)

    _check_name = field_validator("object")(check_object_name)


class DataObject(_Frozen):
    name: str
    rank: int = Field(ge=0, lt=2**31)
    nbytes: int = Field(ge=0, lt=_MAX_INT)

    _check_name = field_validator("name")(check_object_name)


class EntryRecord(_Frozen):
    path: str
    kind: Literal["tensor", "pickle"]
    dtype: str
    shape: list[int]
    stride: list[int]
    device: str
    nbytes: int = Field(ge=0, lt=_MAX_INT)
    ranges: list[ByteRange]

    @model_validator(mode="after")
    def _consistent(self) -> EntryRecord:
        if sum(r.nbytes for r in self.ranges) != self.nbytes:
            raise ValueError(f"{self.path}: byte ranges do not add up to {self.nbytes}")
        itemsize = dtype_itemsize(self.dtype)
        if any(not 0 <= d < _MAX_INT for d in self.shape) or len(self.shape) > 64:
            raise ValueError(f"{self.path}: invalid shape {self.shape}")
        if len(self.stride) != len(self.shape):
            raise ValueError(f"{self.path}: stride {self.stride} does not match shape {self.shape}")
        expected = math.prod(self.shape) * itemsize
        if expected != self.nbytes:
            raise ValueError(f"{self.path}: shape {self.shape} of {self.dtype} is {expected} bytes, not {self.nbytes}")
        if self.kind == "pickle" and (self.dtype != "uint8" or len(self.shape) != 1):
            raise ValueError(f"{self.path}: a pickle entry is a flat uint8 blob")
        return self


class Manifest(_Frozen):
    format: Literal["aiosnap"] = "aiosnap"
    format_version: int
    step: int = Field(ge=0, lt=10**20)
    save_id: str
    created_at: float
    world_size: int = Field(ge=1, lt=2**31)
    objects: list[DataObject]
    entries: list[EntryRecord]
    tree: Any
    metadata: dict[str, Any]

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
        spans: dict[str, list[tuple[int, int]]] = {}
        for entry in self.entries:
            for r in entry.ranges:
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
        check_tree(self.tree, [e.kind for e in self.entries])
        return self

    @property
    def total_bytes(self) -> int:
        return sum(o.nbytes for o in self.objects)

    def to_json(self) -> bytes:
        """The document, its last field the crc32c of every byte before that field."""
        body = self.model_dump_json().encode("utf-8")
        return body[:-1] + _CRC_FIELD + b"%d}" % crc32c_of(body)

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and validate; every problem is a :class:`ManifestError` naming ``where``."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where}: {len(data)} bytes is too large for a manifest")
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise ManifestError(f"{where}: not valid JSON: {exc}") from exc
        if isinstance(doc, dict) and doc.get("format") == "aiosnap":
            _check_version(doc.get("format_version"), where)  # a newer aiosnap's manifest: say so
            if doc["format_version"] >= 2:  # version 1 had no checksum
                found = doc.pop("crc32c", None)
                cut = data.rfind(_CRC_FIELD)
                if type(found) is not int or cut < 0 or crc32c_of(data[:cut] + b"}") != found:
                    raise ManifestError(f"{where}: the manifest is damaged (its crc32c does not match its bytes)")
        return cls.from_document(doc, where)

    @classmethod
    def from_document(cls, doc: Any, where: str) -> Manifest:
        """Validate an already parsed JSON document (a spool journal carries one, whose
        integrity the journal's own checksums cover)."""
        if not isinstance(doc, dict) or doc.get("format") != "aiosnap":
            raise ManifestError(f"{where}: not an aiosnap manifest")
        _check_version(doc.get("format_version"), where)
        try:
            return cls.model_validate(doc)
        except ValidationError as exc:
            raise ManifestError(f"{where}: invalid manifest: {_describe(exc)}") from None
        except (ValueError, TypeError, RecursionError) as exc:
            raise ManifestError(f"{where}: invalid manifest: {exc}") from None


def _check_version(version: Any, where: str) -> None:
    if type(version) is not int or not 1 <= version <= FORMAT_VERSION:
        raise ManifestError(
            f"{where}: format version {version!r:.40} is not supported "
            f"(this aiosnap reads 1 to {FORMAT_VERSION}; upgrade aiosnap for newer ones)"
        )


def _describe(exc: ValidationError) -> str:
    """The first problems, located, without echoing input values (which may be huge)."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '/'}: {e['msg']}" for e in exc.errors()[:5])


Checksums = dict[tuple[str, int], int]
"""crc32c of each byte range, keyed by (object name, offset in the object)."""


def build_manifest(spec: SaveSpec, crcs: Checksums | None = None) -> Manifest:
    """The manifest of ``spec``, every range's crc32c taken from ``crcs`` (KeyError if one is
    missing; all 0 when ``crcs`` is None). Validated like any manifest read back."""
    ranges: list[list[ByteRange]] = [[] for _ in spec.entries]
    for chunk in spec.chunks:
        for piece in chunk.pieces:
            if not 0 <= piece.entry < len(spec.entries):  # a spec read back from a journal
                raise ValueError(
                    f"object {chunk.object_name!r:.80}: a piece of entry {piece.entry}, "
                    f"but the save has {len(spec.entries)} entries"
                )
            crc = 0 if crcs is None else crcs[(chunk.object_name, piece.dst_offset)]
            ranges[piece.entry].append(
                ByteRange(object=chunk.object_name, offset=piece.dst_offset, nbytes=piece.nbytes, crc32c=crc)
            )
    entries = [
        EntryRecord(
            path=e.path,
            kind=e.kind,  # type: ignore[arg-type]
            dtype=e.dtype,
            shape=list(e.shape),
            stride=list(e.stride),
            device=e.device,
            nbytes=e.nbytes,
            ranges=ranges[index],
        )
        for index, e in enumerate(spec.entries)
    ]
    return Manifest(
        format_version=FORMAT_VERSION,
        step=spec.step,
        save_id=spec.save_id,
        created_at=time.time(),
        world_size=spec.world_size,
        objects=[DataObject(name=c.object_name, rank=spec.rank, nbytes=c.nbytes) for c in spec.chunks],
        entries=entries,
        tree=spec.tree,
        metadata=spec.metadata,
    )
