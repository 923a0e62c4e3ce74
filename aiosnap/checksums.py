"""CRC32C (Castagnoli): one home for every checksum aiosnap computes.

The ``crc32c`` package is hardware accelerated and releases the GIL; these helpers run on
whichever thread calls them (callers put large buffers on worker threads).
"""

from __future__ import annotations

import base64
from pathlib import Path

import crc32c

__all__ = ["crc32c_b64", "crc32c_of", "file_crc32c", "file_crc32c_with_pieces"]

BLOCK = 8 * 1024 * 1024


def crc32c_of(data: memoryview | bytes, previous: int = 0) -> int:
    """CRC32C of ``data``, continuing ``previous`` (the crc of the bytes before it)."""
    return int(crc32c.crc32c(data, previous))


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


def file_crc32c_with_pieces(path: str | Path, pieces: list[tuple[int, int]]) -> tuple[int, list[int]]:
    """CRC32C of a whole file and of each ``(offset, nbytes)`` piece of it, reading the file
    once. The file is a spooled chunk: at most one slab in size."""
    with open(path, "rb") as f:
        data = memoryview(f.read())
    return crc32c_of(data), [crc32c_of(data[o : o + n]) for o, n in pieces]
