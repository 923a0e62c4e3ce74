"""The manifest: a step's commit marker, written last, JSON (never pickle), versioned.

It maps the state's tree to byte ranges of data objects, each with a crc32c. Object names
are relative to the storage root and are checked on load: a name that could leave the root
(absolute, ``..``, backslashes) makes the whole manifest invalid.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ManifestError
from .plan import SavePlan, step_dir

__all__ = ["FORMAT_VERSION", "Checksums", "Manifest", "build_manifest", "check_object_name", "manifest_name"]

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"


def manifest_name(step: int) -> str:
    """Root-relative name of a step's manifest."""
    return f"{step_dir(step)}/{MANIFEST_FILE}"


def check_object_name(name: str) -> str:
    """Return ``name`` if it is a normalised root-relative name, else raise ValueError."""
    if not name or name.startswith("/") or "\\" in name or "\x00" in name or ":" in name:
        raise ValueError(f"unsafe object name {name!r}")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise ValueError(f"unsafe object name {name!r}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; ValueError for anything that is not a dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ByteRange(_Frozen):
    object: str
    offset: int = Field(ge=0)
    nbytes: int = Field(gt=0)
    crc32c: int = Field(ge=0, lt=2**32)

    _check_name = field_validator("object")(check_object_name)


class DataObject(_Frozen):
    name: str
    rank: int = Field(ge=0)
    nbytes: int = Field(ge=0)

    _check_name = field_validator("name")(check_object_name)


class EntryRecord(_Frozen):
    path: str
    kind: Literal["tensor", "pickle"]
    dtype: str
    shape: list[int]
    stride: list[int]
    device: str
    nbytes: int = Field(ge=0)
    ranges: list[ByteRange]

    @model_validator(mode="after")
    def _consistent(self) -> EntryRecord:
        if sum(r.nbytes for r in self.ranges) != self.nbytes:
            raise ValueError(f"{self.path}: byte ranges do not add up to {self.nbytes}")
        if self.kind == "tensor":
            dtype = dtype_from_name(self.dtype)
            if any(d < 0 for d in self.shape):
                raise ValueError(f"{self.path}: negative dimension in shape {self.shape}")
            expected = math.prod(self.shape) * dtype.itemsize
            if expected != self.nbytes:
                raise ValueError(
                    f"{self.path}: shape {self.shape} of {self.dtype} is {expected} bytes, not {self.nbytes}"
                )
        return self


class Manifest(_Frozen):
    format: Literal["aiosnap"] = "aiosnap"
    format_version: int
    step: int = Field(ge=0)
    save_id: str
    created_at: float
    world_size: int = Field(ge=1)
    objects: list[DataObject]
    entries: list[EntryRecord]
    tree: Any
    metadata: dict[str, Any]

    @model_validator(mode="after")
    def _ranges_inside_objects(self) -> Manifest:
        sizes = {o.name: o.nbytes for o in self.objects}
        for entry in self.entries:
            for r in entry.ranges:
                if r.object not in sizes:
                    raise ValueError(f"{entry.path}: range names unknown object {r.object!r}")
                if r.offset + r.nbytes > sizes[r.object]:
                    raise ValueError(f"{entry.path}: range runs past the end of {r.object!r}")
        return self

    @property
    def total_bytes(self) -> int:
        return sum(o.nbytes for o in self.objects)

    def with_checksums(self, crcs: Checksums) -> Manifest:
        """A copy with every range's crc32c taken from ``crcs`` (KeyError if one is missing)."""
        entries = [
            e.model_copy(
                update={"ranges": [r.model_copy(update={"crc32c": crcs[(r.object, r.offset)]}) for r in e.ranges]}
            )
            for e in self.entries
        ]
        return self.model_copy(update={"entries": entries, "created_at": time.time()})

    def to_json(self) -> bytes:
        return self.model_dump_json().encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and validate; every problem is a :class:`ManifestError` naming ``where``."""
        try:
            doc = json.loads(data)
        except ValueError as exc:
            raise ManifestError(f"{where}: not valid JSON: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != "aiosnap":
            raise ManifestError(f"{where}: not an aiosnap manifest")
        version = doc.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ManifestError(
                f"{where}: format version {version!r} is not supported "
                f"(this aiosnap reads up to {FORMAT_VERSION}); upgrade aiosnap"
            )
        try:
            return cls.model_validate(doc)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
            raise ManifestError(f"{where}: invalid manifest: {problems}") from exc


Checksums = dict[tuple[str, int], int]
"""crc32c of each byte range, keyed by (object name, offset in the object)."""


def build_manifest(plan: SavePlan) -> Manifest:
    """The manifest of ``plan`` with every crc32c still 0: fill them with
    :meth:`Manifest.with_checksums` once the chunks are checksummed. Pure, JSON-able, so a
    spool journal can carry it across a crash."""
    ranges: dict[int, list[ByteRange]] = {e.index: [] for e in plan.entries}
    for chunk in plan.chunks:
        for piece in chunk.pieces:
            ranges[piece.entry].append(
                ByteRange(
                    object=chunk.object_name,
                    offset=piece.dst_offset,
                    nbytes=piece.nbytes,
                    crc32c=0,
                )
            )
    entries = [
        EntryRecord(
            path=e.path,
            kind=e.kind,
            dtype=str(e.tensor.dtype).removeprefix("torch."),
            shape=list(e.tensor.shape),
            stride=list(e.tensor.stride()),
            device=str(e.tensor.device),
            nbytes=e.nbytes,
            ranges=ranges[e.index],
        )
        for e in plan.entries
    ]
    return Manifest(
        format_version=FORMAT_VERSION,
        step=plan.step,
        save_id=plan.save_id,
        created_at=time.time(),
        world_size=plan.world_size,
        objects=[DataObject(name=c.object_name, rank=plan.rank, nbytes=c.nbytes) for c in plan.chunks],
        entries=entries,
        tree=plan.tree,
        metadata=plan.metadata,
    )
