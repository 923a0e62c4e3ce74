"""Safetensors headers: built for export, parsed (as untrusted input) for import.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON
(an object mapping each tensor's name to ``{"dtype", "shape", "data_offsets": [begin,
end]}``, and optionally ``"__metadata__"`` to an object of strings; the JSON may be padded
with trailing spaces), then the tensors' bytes, row-major, little-endian, offsets relative
to the end of the header, with no holes and no overlaps.

:func:`parse_header` checks all of it before anything is allocated for a tensor: ``N``
against the file's size (so a hostile length cannot make a reader allocate more than the
file holds), JSON that is one object with no duplicate key, read one member at a time so
that a hostile JSON cannot make parsing allocate more than a few times the header's size,
UTF-8 names (no lone surrogates), known dtypes, shapes of at most 64 dimensions each below
2**63 whose row-major strides fit in 64 bits, sizes that match dtype x shape, offsets in
range that tile the data section exactly. Every problem is a :class:`~aiosnap.errors.CorruptCheckpointError`
naming the file. Pure code, no torch, no I/O; runs on whichever thread calls.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import CorruptCheckpointError
from ...storage.base import BytesLike
from .jsonwalk import expect_end, read_small_value, read_string, skip_space, walk_object

__all__ = [
    "AIOSNAP_OF_CODE",
    "CODE_OF_AIOSNAP",
    "HEADER_ALIGN",
    "ITEMSIZE",
    "MAX_HEADER_BYTES",
    "HeaderTensor",
    "ParsedHeader",
    "build_header",
    "header_length",
    "parse_header",
]

MAX_HEADER_BYTES = 100_000_000
"""Largest header accepted (the reference implementation's limit)."""
HEADER_ALIGN = 8
"""The header is padded with spaces so that the data starts at a multiple of this."""
MAX_DIMS = 64
MAX_SPEC_CHARS = 4096
"""Longest description of one tensor (``{"dtype": ..., "shape": [...], ...}``) read."""
_LENGTH = struct.Struct("<Q")
_MAX_INT = 2**63
_INT = r"(?:0|[1-9][0-9]{0,30})"
_COMPACT_SPEC = re.compile(
    rf'\{{"dtype":"([A-Z0-9_]{{1,16}})","shape":\[((?:{_INT}(?:,{_INT}){{0,63}})?)\],"data_offsets":\[({_INT}),({_INT})\]\}}'
)
"""A tensor's description as the library (and :func:`build_header`) writes it: parsed by
this pattern alone (the same values ``json`` would give), anything else by the JSON parser."""

CODE_OF_AIOSNAP: dict[str, str] = {
    "bool": "BOOL",
    "uint8": "U8", "int8": "I8", "uint16": "U16", "int16": "I16",
    "uint32": "U32", "int32": "I32", "uint64": "U64", "int64": "I64",
    "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64",
    "float8_e5m2": "F8_E5M2", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "complex64": "C64",
}  # fmt: skip
"""aiosnap dtype names (torch's) -> safetensors dtype codes, for what both can hold and
``safetensors.torch`` reads back."""
AIOSNAP_OF_CODE: dict[str, str] = {code: name for name, code in CODE_OF_AIOSNAP.items()}
AIOSNAP_OF_CODE["F8_E8M0"] = "float8_e8m0fnu"  # read, never written (safetensors.torch cannot load it)
ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8, "I64": 8,
    "F16": 2, "BF16": 2, "F32": 4, "F64": 8, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E5M2FNUZ": 1,
    "F8_E4M3FNUZ": 1, "F8_E8M0": 1, "C64": 8,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class HeaderTensor:
    """One tensor of a header: ``begin``/``end`` are offsets in the data section."""

    name: str
    dtype: str  # the safetensors code ("BF16")
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def aiosnap_dtype(self) -> str:
        return AIOSNAP_OF_CODE[self.dtype]


@dataclass(frozen=True)
class ParsedHeader:
    """A checked header: its tensors (in data order), its ``__metadata__``, and where the
    data section starts in the file (``8 + N``)."""

    tensors: list[HeaderTensor]
    metadata: dict[str, str]
    data_start: int


def build_header(tensors: Sequence[tuple[str, str, Sequence[int]]], metadata: dict[str, str]) -> bytes:
    """The first bytes of a safetensors file holding ``tensors`` (name, safetensors dtype
    code, shape), one after the other in that order: the length, the JSON and the padding
    that puts the data at a multiple of :data:`HEADER_ALIGN`."""
    document: dict[str, Any] = {}
    if metadata:
        document["__metadata__"] = dict(metadata)
    offset = 0
    for name, code, shape in tensors:
        nbytes = math.prod(shape) * ITEMSIZE[code]
        document[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    body = json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-(len(body) + _LENGTH.size) % HEADER_ALIGN)
    return _LENGTH.pack(len(body)) + body


def header_length(first: bytes, file_size: int, where: str) -> int:
    """``N`` from a file's first 8 bytes, checked against the file's size before anything
    is read or allocated for the header."""
    if file_size < _LENGTH.size or len(first) < _LENGTH.size:
        raise CorruptCheckpointError(f"{where}: {file_size} bytes is too short for a safetensors file")
    (length,) = _LENGTH.unpack_from(first)
    if length < 2 or length > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(
            f"{where}: header length {length} is out of range (2 to {MAX_HEADER_BYTES} bytes): not a safetensors file"
        )
    if _LENGTH.size + length > file_size:
        raise CorruptCheckpointError(f"{where}: a {length}-byte header runs past the end of a {file_size}-byte file")
    return int(length)


def _strict_int(value: Any) -> bool:
    return type(value) is int


def _tensor(name: str, spec: Any, data_size: int) -> HeaderTensor:
    label = f"tensor {name!r:.120}"
    if not name:
        raise ValueError("a tensor has an empty name")
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"{label}: expected exactly dtype, shape and data_offsets")
    code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(code, str) or code not in ITEMSIZE:
        raise ValueError(f"{label}: unknown dtype {code!r:.40}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(_strict_int(d) and 0 <= d < _MAX_INT for d in shape)
    ):
        raise ValueError(f"{label}: shape must be at most {MAX_DIMS} integers from 0 to 2**63 - 1")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_strict_int(o) for o in offsets)):
        raise ValueError(f"{label}: data_offsets must be two integers")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise ValueError(f"{label}: data_offsets {[begin, end]} lie outside the {data_size}-byte data section")
    itemsize = ITEMSIZE[code]
    span = itemsize  # the bytes a row-major layout spans, a dimension of 0 counted as 1 (as strides are)
    for d in shape:
        span *= max(d, 1)
        if span >= _MAX_INT:
            raise ValueError(f"{label}: shape {shape!s:.120} of {code} is too large to address")
    nbytes = math.prod(shape) * itemsize
    if nbytes != end - begin:
        raise ValueError(f"{label}: shape {shape} of {code} is {nbytes} bytes, its data_offsets span {end - begin}")
    return HeaderTensor(name, code, tuple(shape), begin, end)


def parse_header(data: BytesLike, file_size: int, where: str) -> ParsedHeader:
    """The checked header of a file of ``file_size`` bytes whose first ``8 + N`` bytes are
    ``data`` (see the module docstring); :class:`CorruptCheckpointError` naming ``where``.

    The JSON is walked one member at a time (:mod:`.jsonwalk`): each tensor's description
    is parsed within :data:`MAX_SPEC_CHARS` characters and kept as a small record, so what
    parsing allocates is bounded by the header's size (a few times it), whatever its JSON."""
    view = memoryview(data).cast("B")
    length = header_length(bytes(view[: _LENGTH.size]), file_size, where)
    if len(view) < _LENGTH.size + length:
        raise CorruptCheckpointError(f"{where}: the header is cut short ({len(view) - _LENGTH.size} of {length} bytes)")
    data_start = _LENGTH.size + length
    data_size = file_size - data_start
    tensors: list[HeaderTensor] = []
    metadata: dict[str, str] = {}

    def member(key: str, pos: int) -> int:
        if key == "__metadata__":
            return _metadata(text, pos, metadata)
        compact = _COMPACT_SPEC.match(text, pos)
        if compact is not None:  # what writers write: read without building a JSON object
            code, dims, begin, end = compact.groups()
            spec = {"dtype": code, "shape": [int(d) for d in dims.split(",")] if dims else [],
                    "data_offsets": [int(begin), int(end)]}  # fmt: skip
            tensors.append(_tensor(key, spec, data_size))
            return compact.end()
        spec, after = read_small_value(text, pos, MAX_SPEC_CHARS)
        tensors.append(_tensor(key, spec, data_size))
        return after

    try:
        if bytes(view[_LENGTH.size : _LENGTH.size + 1]) != b"{":
            raise ValueError("the header is not a JSON object")
        text = str(view[_LENGTH.size : data_start], "utf-8")
        expect_end(text, walk_object(text, 0, member))
        _check_tiling(tensors, data_size)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CorruptCheckpointError(f"{where}: invalid safetensors header: {exc}") from None
    tensors.sort(key=lambda t: (t.begin, t.end))
    return ParsedHeader(tensors, metadata, data_start)


def _metadata(text: str, pos: int, into: dict[str, str]) -> int:
    """Read ``__metadata__`` (an object of strings) at ``pos`` into ``into``."""

    def member(key: str, at: int) -> int:
        if not text.startswith('"', skip_space(text, at)):
            raise ValueError("__metadata__ must map strings to strings")
        into[key], end = read_string(text, at)
        return end

    if not text.startswith("{", skip_space(text, pos)):
        raise ValueError("__metadata__ must map strings to strings")
    return walk_object(text, pos, member)


def _check_tiling(tensors: list[HeaderTensor], data_size: int) -> None:
    """The tensors' byte ranges cover the data section exactly: no hole, no overlap."""
    position = 0
    for t in sorted(tensors, key=lambda t: (t.begin, t.end)):
        if t.begin != position:
            what = "a hole" if t.begin > position else "overlapping tensors"
            raise ValueError(f"{what} at data offset {min(t.begin, position)} (tensor {t.name!r:.120})")
        position = t.end
    if position != data_size:
        raise ValueError(f"the tensors end at data offset {position}; the data section has {data_size} bytes")
