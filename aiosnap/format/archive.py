"""A checkpoint as one file that ``torch.load`` reads: the zip layout of ``torch.save``.

Pure code, no I/O. The file is laid out up front, when a save is planned (see
:func:`aiosnap.trainer.archive_plan.layout_archive`): every tensor is a *stored* zip record
``archive/data/<entry>`` whose local header sits right before its bytes and whose bytes
start at a multiple of :data:`ALIGN` (what ``torch.load(mmap=True)`` expects), so the data
chunks are byte ranges of the file and can be written in any order. What only the commit
knows -- the aiosnap manifest with every range's crc32c -- goes into the *tail*, written
last, with the pickle ``torch.load`` reads, the other records ``torch.save`` writes, and the
zip's central directory (zip64 where sizes or offsets need it).

Zip CRC-32 fields are 0, as with ``torch.serialization.set_crc32_options(False)``:
``torch.load`` does not check them; aiosnap checks its own crc32c of every byte range.
The end-of-central-directory comment names the aiosnap manifest's place in the file
(:func:`parse_trailer`), so a reader finds it with one small read of the file's end.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ALIGN",
    "ARCHIVE",
    "MANIFEST_RECORD",
    "MARKS_BYTES",
    "MAX_TRAILER_BYTES",
    "Record",
    "Trailer",
    "build_tail",
    "data_record_name",
    "has_aiosnap_marks",
    "local_header",
    "parse_trailer",
    "zip_directory",
]

ARCHIVE = "archive"
"""The folder every record sits in (``torch.save`` names it after the file; any name works)."""
ALIGN = 64
"""Alignment of every record's data in the file (``torch.save``'s ``.storage_alignment``)."""
MANIFEST_RECORD = f"{ARCHIVE}/.data/aiosnap/manifest.json"

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # signature ... extra field length (30 bytes)
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_EOCD = struct.Struct("<IHHHHIIH")  # 22 bytes
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
_LOCAL_SIG, _CENTRAL_SIG, _EOCD_SIG = 0x04034B50, 0x02014B50, 0x06054B50
_EOCD64_SIG, _LOCATOR_SIG = 0x06064B50, 0x07064B50
_ZIP64 = 0x0001
_PADDING = 0x4246  # "FB": the padding field torch.save uses
_U32 = 0xFFFFFFFF
_U16 = 0xFFFF
_VERSION = 45  # zip64-capable "version needed"
_DOS_DATE = (2020 - 1980) << 9 | 1 << 5 | 1  # a fixed timestamp: the file's mtime is the real one
_UTF8 = 1 << 11
_COMMENT = re.compile(rb"aiosnap-archive step=(\d{1,20}) save=([0-9a-f]{16}) manifest=(\d{1,20})\+(\d{1,20})")
MAX_TRAILER_BYTES = _EOCD.size + 128
"""Bytes at the end of the file that hold the end record and its comment."""
MARKS_BYTES = 1024
"""Bytes at the end of the file that hold :func:`has_aiosnap_marks`' marks (the end records,
the comment and the central directory entry of the manifest, which comes last)."""
_MARKS = (b"aiosnap-archive ", MANIFEST_RECORD.split("/", 1)[1].encode())


def data_record_name(entry: int) -> str:
    """The record of entry ``entry`` (its storage key in the pickle is ``str(entry)``)."""
    return f"{ARCHIVE}/data/{entry}"


@dataclass(frozen=True)
class Record:
    """One stored record: its name, where its local header starts, its data size."""

    name: str
    header_offset: int
    nbytes: int


def local_header(name: str, nbytes: int, at: int) -> bytes:
    """The local header of a stored record whose header starts at file offset ``at``,
    padded so that its data starts at a multiple of :data:`ALIGN`."""
    encoded = name.encode("utf-8")
    zip64 = nbytes >= _U32
    extra = struct.pack("<HHQQ", _ZIP64, 16, nbytes, nbytes) if zip64 else b""
    fixed = _LOCAL.size + len(encoded) + len(extra) + 4  # + the padding field's own header
    padding = -(at + fixed) % ALIGN
    extra += struct.pack("<HH", _PADDING, padding) + bytes(padding)
    size32 = _U32 if zip64 else nbytes
    head = _LOCAL.pack(_LOCAL_SIG, _VERSION, _UTF8, 0, 0, _DOS_DATE, 0, size32, size32, len(encoded), len(extra))
    return head + encoded + extra


def _central_entry(record: Record) -> bytes:
    encoded = record.name.encode("utf-8")
    values = []
    size32 = record.nbytes
    offset32 = record.header_offset
    if record.nbytes >= _U32:
        values += [record.nbytes, record.nbytes]
        size32 = _U32
    if record.header_offset >= _U32:
        values.append(record.header_offset)
        offset32 = _U32
    extra = struct.pack(f"<HH{len(values)}Q", _ZIP64, 8 * len(values), *values) if values else b""
    head = _CENTRAL.pack(
        _CENTRAL_SIG, _VERSION, _VERSION, _UTF8, 0, 0, _DOS_DATE, 0, size32, size32,
        len(encoded), len(extra), 0, 0, 0, 0o644 << 16, offset32,
    )  # fmt: skip
    return head + encoded + extra


def build_tail(
    at: int,
    data_records: Sequence[Record],
    pickle_bytes: bytes,
    manifest_bytes: bytes,
    *,
    step: int,
    save_id: str,
) -> bytes:
    """Everything after the data chunks, which end at file offset ``at``: the pickle
    (``data.pkl``), ``torch.save``'s small records, the aiosnap manifest, the central
    directory and the end records."""
    out = bytearray()
    records = list(data_records)
    manifest_at = 0
    small = [
        ("data.pkl", pickle_bytes),
        (".format_version", b"1"),
        (".storage_alignment", str(ALIGN).encode()),
        ("byteorder", b"little"),
        ("version", b"3\n"),
        (".data/aiosnap/manifest.json", manifest_bytes),
    ]
    for name, data in small:
        full = f"{ARCHIVE}/{name}"
        header = local_header(full, len(data), at + len(out))
        records.append(Record(full, at + len(out), len(data)))
        out += header
        if full == MANIFEST_RECORD:
            manifest_at = at + len(out)
        out += data
    comment = b"aiosnap-archive step=%d save=%s manifest=%d+%d" % (
        step, save_id.encode("ascii"), manifest_at, len(manifest_bytes),
    )  # fmt: skip
    out += zip_directory(records, at + len(out), comment)
    return bytes(out)


def zip_directory(records: Sequence[Record], at: int, comment: bytes = b"") -> bytes:
    """The central directory of ``records`` and the end records (zip64 where needed), for a
    directory that starts at offset ``at`` of the archive."""
    out = bytearray()
    for record in records:
        out += _central_entry(record)
    directory_size = len(out)
    count = len(records)
    if count >= _U16 or at >= _U32 or directory_size >= _U32:
        end64_at = at + len(out)
        out += _EOCD64.pack(_EOCD64_SIG, _EOCD64.size - 12, _VERSION, _VERSION, 0, 0, count, count, directory_size, at)
        out += _LOCATOR.pack(_LOCATOR_SIG, 0, end64_at, 1)
    out += _EOCD.pack(
        _EOCD_SIG, 0, 0, min(count, _U16), min(count, _U16), min(directory_size, _U32), min(at, _U32), len(comment),
    )  # fmt: skip
    out += comment
    return bytes(out)


@dataclass(frozen=True)
class Trailer:
    """What the end of an aiosnap archive says: its step and save id, and where its
    manifest lies (``manifest_offset``, ``manifest_nbytes``)."""

    step: int
    save_id: str
    manifest_offset: int
    manifest_nbytes: int


def parse_trailer(tail: bytes, file_size: int) -> Trailer | None:
    """Read the last :data:`MAX_TRAILER_BYTES` (or fewer) bytes of a file of ``file_size``
    bytes: the archive's :class:`Trailer`, or None when the file is not an aiosnap archive
    (a ``torch.save`` file, a file being written, anything else). Untrusted input: the
    manifest's place is checked against the file's size, not more."""
    found = tail.rfind(struct.pack("<I", _EOCD_SIG))
    if found < 0 or len(tail) - found < _EOCD.size:
        return None
    *_, comment_length = _EOCD.unpack_from(tail, found)
    comment = tail[found + _EOCD.size :]
    if comment_length != len(comment):
        return None
    match = _COMMENT.fullmatch(comment)
    if match is None:
        return None
    step, offset, nbytes = int(match[1]), int(match[3]), int(match[4])
    if offset + nbytes > file_size - len(tail) + found:
        return None
    return Trailer(step, match[2].decode("ascii"), offset, nbytes)


def has_aiosnap_marks(tail: bytes) -> bool:
    """True when the last :data:`MARKS_BYTES` (or fewer) bytes of a file carry aiosnap's
    marks: the start of the trailer's comment, or the name of the manifest's record in the
    central directory. A file that has them but no :func:`parse_trailer` trailer is an aiosnap
    archive whose end is damaged (one byte is enough: ``torch.load`` reads on without it)."""
    return any(mark in tail for mark in _MARKS)
