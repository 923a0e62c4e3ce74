"""Lossless compression of one stored byte range: zstd, after a byte shuffle for
multi-byte dtypes (byte 0 of every element, then byte 1, ...: the exponent bytes of
bf16/fp16/fp32 values then sit together, and compress).

Runs on whichever thread calls it (callers use worker threads; zstd releases the GIL). A
stored frame is untrusted input: :func:`decompress_into` writes into a destination of the
range's size and never more, bounds zstd's window, and raises ValueError for a frame that
is corrupt, too short or too long.
"""

from __future__ import annotations

import zstandard

__all__ = ["LEVEL", "MAX_WINDOW", "compress_range", "decompress_into", "shuffle_into", "unshuffle_into"]

LEVEL = 3
MAX_WINDOW = 1 << 27
"""The largest zstd window a stored frame may ask for (what we write uses far less)."""
_BLOCK = 1 << 20


def shuffle_into(data: memoryview, out: memoryview, itemsize: int) -> None:
    """``out`` = byte 0 of every ``itemsize``-byte element of ``data``, then byte 1, ..."""
    import numpy as np  # a transposing copy at memory speed (numpy comes with torch)

    source = np.frombuffer(data, dtype=np.uint8).reshape(-1, itemsize)
    np.copyto(np.frombuffer(out, dtype=np.uint8).reshape(itemsize, -1), source.T)


def unshuffle_into(data: memoryview, out: memoryview, itemsize: int) -> None:
    """The inverse of :func:`shuffle_into`."""
    import numpy as np

    source = np.frombuffer(data, dtype=np.uint8).reshape(itemsize, -1)
    np.copyto(np.frombuffer(out, dtype=np.uint8).reshape(-1, itemsize), source.T)


def compress_range(data: memoryview, itemsize: int, level: int = LEVEL) -> bytes | None:
    """``data`` shuffled by ``itemsize`` (1: not shuffled) and zstd-compressed; None when
    that is not smaller than ``data`` (the range is stored raw)."""
    source = data
    if itemsize > 1:
        shuffled = memoryview(bytearray(data.nbytes))
        shuffle_into(data, shuffled, itemsize)
        source = shuffled
    frame = zstandard.ZstdCompressor(level=level).compress(source)
    return frame if len(frame) < data.nbytes else None


def _inflate(frame: memoryview, dest: memoryview) -> None:
    reader = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).stream_reader(frame, read_across_frames=False)
    filled = 0
    try:
        while filled < dest.nbytes:
            got = reader.readinto(dest[filled : filled + _BLOCK])
            if not got:
                raise ValueError(f"the frame holds {filled} bytes, the range {dest.nbytes}")
            filled += got
        if reader.read(1):
            raise ValueError(f"the frame holds more than the range's {dest.nbytes} bytes")
    except zstandard.ZstdError as exc:
        raise ValueError(f"not a valid zstd frame: {exc}") from None
    finally:
        reader.close()  # type: ignore[no-untyped-call]


def decompress_into(frame: memoryview, dest: memoryview, itemsize: int) -> None:
    """Decompress ``frame`` into ``dest`` (exactly its size), unshuffling by ``itemsize``
    through one scratch buffer of its size; ValueError if the frame does not hold exactly
    that many bytes."""
    if itemsize <= 1:
        _inflate(frame, dest)
        return
    scratch = memoryview(bytearray(dest.nbytes))
    _inflate(frame, scratch)
    unshuffle_into(scratch, dest, itemsize)
