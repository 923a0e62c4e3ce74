"""Safetensors headers: built for export, parsed (as untrusted input) for import.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON
(an object mapping each tensor's name to ``{"dtype", "shape", "data_offsets": [begin,
end]}``, and optionally ``"__metadata__"`` to an object of strings; the JSON may be padded
with trailing spaces), then the tensors' bytes, row-major, little-endian, offsets relative
to the end of the header, with no holes and no overlaps.

:func:`parse_header` checks all of it before anything is allocated for a tensor: ``N``
against the file's size (so a hostile length cannot make a reader allocate more than the
file holds), JSON that is one object with no duplicate key, known dtypes, shapes of at most
64 non-negative dimensions, sizes that match dtype x shape, offsets in range that tile the
data section exactly. Every problem is a :class:`~aiosnap.errors.CorruptCheckpointError`
naming the file. Pure code, no torch, no I/O; runs on whichever thread calls.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import CorruptCheckpointError

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
_LENGTH = struct.Struct("<Q")

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


@dataclass(frozen=True)
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


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise ValueError(f"key {key!r:.80} appears twice")
        found[key] = value
    return found


def _strict_int(value: Any) -> bool:
    return type(value) is int


def _tensor(name: str, spec: Any, data_size: int) -> HeaderTensor:
    label = f"tensor {name!r:.120}"
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"{label}: expected exactly dtype, shape and data_offsets")
    code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(code, str) or code not in ITEMSIZE:
        raise ValueError(f"{label}: unknown dtype {code!r:.40}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_strict_int(d) and d >= 0 for d in shape):
        raise ValueError(f"{label}: shape must be at most {MAX_DIMS} non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_strict_int(o) for o in offsets)):
        raise ValueError(f"{label}: data_offsets must be two integers")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise ValueError(f"{label}: data_offsets {[begin, end]} lie outside the {data_size}-byte data section")
    nbytes = ITEMSIZE[code]
    for d in shape:  # stops as soon as the product is out of reach: a huge shape is refused
        nbytes *= d
        if nbytes > data_size:
            raise ValueError(f"{label}: shape {shape!s:.120} of {code} holds more bytes than the file has")
    if nbytes != end - begin:
        raise ValueError(f"{label}: shape {shape} of {code} is {nbytes} bytes, its data_offsets span {end - begin}")
    return HeaderTensor(name, code, tuple(shape), begin, end)


def parse_header(data: bytes, file_size: int, where: str) -> ParsedHeader:
    """The checked header of a file of ``file_size`` bytes whose first ``8 + N`` bytes are
    ``data`` (see the module docstring); :class:`CorruptCheckpointError` naming ``where``."""
    length = header_length(data[: _LENGTH.size], file_size, where)
    if len(data) < _LENGTH.size + length:
        raise CorruptCheckpointError(f"{where}: the header is cut short ({len(data) - _LENGTH.size} of {length} bytes)")
    body = data[_LENGTH.size : _LENGTH.size + length]
    data_start = _LENGTH.size + length
    data_size = file_size - data_start
    try:
        if body[:1] != b"{":
            raise ValueError("the header is not a JSON object")
        document = json.loads(body.decode("utf-8"), object_pairs_hook=_no_duplicates)
        if not isinstance(document, dict):
            raise ValueError("the header is not a JSON object")
        metadata = document.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise ValueError("__metadata__ must map strings to strings")
        tensors = [_tensor(name, spec, data_size) for name, spec in document.items()]
        if any(not t.name for t in tensors):
            raise ValueError("a tensor has an empty name")
        _check_tiling(tensors, data_size)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CorruptCheckpointError(f"{where}: invalid safetensors header: {exc}") from None
    tensors.sort(key=lambda t: (t.begin, t.end))
    return ParsedHeader(tensors, metadata, data_start)


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
