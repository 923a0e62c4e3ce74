"""CRC32C (Castagnoli): one home for every checksum aiosnap computes.

The ``crc32c`` package is hardware accelerated and releases the GIL; these helpers run on
whichever thread calls them (callers put large buffers on worker threads).

:class:`RangeChecksums` reads a buffer once and then answers the CRC32C of any range whose
ends fall on its segment boundaries by combining segment CRCs (:func:`crc32c_combine`, a
few microseconds) instead of reading the bytes again: the manifest's per-tensor CRCs and
S3's per-part CRCs come from the same single pass.
"""

from __future__ import annotations

import base64
import bisect
import functools
from collections.abc import Iterable
from pathlib import Path

import crc32c
import xxhash

__all__ = [
    "ALIGN", "RangeChecksums", "content_digest", "crc32c_b64", "crc32c_combine", "crc32c_of", "file_crc32c",
    "file_crc32c_with_pieces",
]  # fmt: skip

BLOCK = 8 * 1024 * 1024
ALIGN = 1024 * 1024  # segment grid of RangeChecksums: S3 part sizes are multiples of it
_POLY = 0x82F63B78  # CRC32C, bit-reflected


def _multiply_mod_p(a: int, b: int) -> int:
    """a * b modulo the CRC32C polynomial (bit-reflected: x^0 is the top bit)."""
    product = 0
    m = 1 << 31
    while m:
        if a & m:
            product ^= b
            if not a & (m - 1):
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers_of_x() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multiply_mod_p(table[-1], table[-1]))  # x^(2^(k+1))
    return table


_X_TO_2_TO_THE = _powers_of_x()


@functools.lru_cache(maxsize=256)
def _shift_for(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: appending ``nbytes`` bytes multiplies a crc by it."""
    power, k, n = 1 << 31, 3, nbytes
    while n:
        if n & 1:
            power = _multiply_mod_p(_X_TO_2_TO_THE[k & 31], power)
        n >>= 1
        k += 1
    return power


def crc32c_combine(first: int, second: int, second_nbytes: int) -> int:
    """The CRC32C of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)``, without the bytes."""
    if first == 0:  # shifting is linear: 0 stays 0 (a range of one segment, the common case)
        return second
    return _multiply_mod_p(_shift_for(second_nbytes), first) ^ second


def crc32c_of(data: memoryview | bytes, previous: int = 0) -> int:
    """CRC32C of ``data``, continuing ``previous`` (the crc of the bytes before it)."""
    return int(crc32c.crc32c(data, previous))


def content_digest(data: memoryview | bytes) -> str:
    """The xxh3-128 of ``data`` as 32 lower-case hex digits: what incremental saves compare
    (a range whose digest, size and crc32c equal a stored one's is not written again)."""
    return xxhash.xxh3_128_hexdigest(data)


def crc32c_b64(crc: int) -> str:
    """The big-endian base64 form S3 takes in ``x-amz-checksum-crc32c``."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


def file_crc32c(path: str | Path, start: int = 0, end: int | None = None) -> int:
    """CRC32C of bytes ``[start, end)`` of a file (all of it by default), read in 8 MiB blocks."""
    crc = 0
    with open(path, "rb") as f:
        f.seek(start)
        left = None if end is None else end - start
        while left is None or left > 0:
            block = f.read(BLOCK if left is None else min(BLOCK, left))
            if not block:
                break
            crc = crc32c_of(block, crc)
            if left is not None:
                left -= len(block)
    return crc


def file_crc32c_with_pieces(
    path: str | Path, pieces: list[tuple[int, int]], digested: list[tuple[int, int]] | None = None
) -> tuple[int, list[int], list[str] | None]:
    """CRC32C of a whole file and of each ``(offset, nbytes)`` piece of it, and (None when
    ``digested`` is None) the xxh3-128 digest of each ``digested`` piece, reading the file
    once. The file is a spooled chunk: at most one slab in size."""
    with open(path, "rb") as f:
        data = memoryview(f.read())
    checksums = RangeChecksums(data, [b for o, n in pieces for b in (o, o + n)])
    digests = None if digested is None else [content_digest(data[o : o + n]) for o, n in digested]
    return checksums.of(0, data.nbytes), [checksums.of(o, o + n) for o, n in pieces], digests


class RangeChecksums:
    """The CRC32C of a buffer's segments, from one pass over it.

    Segments end at every ``boundaries`` offset and every multiple of :data:`ALIGN`; the
    CRC of a range between two segment boundaries is combined from them without touching
    the bytes. A range with other ends reads just its unaligned edges again. Built on a
    worker thread (one CRC pass); :meth:`of` runs on any thread.
    """

    def __init__(self, data: memoryview, boundaries: Iterable[int] = ()) -> None:
        self._data: memoryview | None = data
        size = data.nbytes
        cuts = {b for b in boundaries if 0 < b < size} | set(range(ALIGN, size, ALIGN))
        self._starts = [0, *sorted(cuts)]
        ends = [*self._starts[1:], size]
        self._crcs = [crc32c_of(data[s:e]) for s, e in zip(self._starts, ends, strict=True)]
        self._ends = ends
        self.size = size

    def of(self, start: int, end: int) -> int:
        """CRC32C of bytes ``[start, end)``."""
        if not 0 <= start <= end <= self.size:
            raise ValueError(f"range [{start}, {end}) outside a buffer of {self.size} bytes")
        if start == end:
            return 0
        first = bisect.bisect_right(self._starts, start) - 1
        crc = 0
        position = start
        index = first
        while position < end:
            seg_start, seg_end = self._starts[index], self._ends[index]
            stop = min(seg_end, end)
            if position == seg_start and stop == seg_end:
                crc = crc32c_combine(crc, self._crcs[index], seg_end - seg_start)
            else:  # an unaligned edge: read just these bytes
                if self._data is None:
                    raise ValueError(f"[{start}, {end}) needs the bytes, released already")
                crc = crc32c_of(self._data[position:stop], crc)
            position = stop
            index += 1
        return crc

    def release(self) -> None:
        """Forget the buffer (ranges on segment boundaries still answer)."""
        self._data = None
