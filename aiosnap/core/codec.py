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

__all__ = [
    "LEVEL", "MAX_WINDOW", "SCRATCH_BYTES", "check_frame", "compress_into", "compress_range", "decompress_into",
    "shuffle_into", "unshuffle_into",
]  # fmt: skip

LEVEL = 3
MAX_WINDOW = 1 << 27
"""The largest zstd window a stored frame may ask for (what we write uses far less)."""
_BLOCK = 1 << 20
SCRATCH_BYTES = 1 << 16
"""The scratch :func:`compress_into` shuffles through (whatever the range's size)."""


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


def compress_into(data: memoryview, out: memoryview, itemsize: int, level: int = LEVEL) -> int | None:
    """Write ``data`` shuffled by ``itemsize`` (1: not shuffled) and zstd-compressed into
    ``out`` (at least ``data``'s size), through at most :data:`SCRATCH_BYTES` of scratch;
    the frame's size, or None when it is not smaller than ``data`` (nothing to use in
    ``out``: the range is stored raw). The frame's header records ``data``'s size."""
    import numpy as np

    nbytes = data.nbytes
    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True).compressobj(size=nbytes)
    written = 0

    def put(frame: bytes) -> bool:
        nonlocal written
        if written + len(frame) >= nbytes:
            return False
        out[written : written + len(frame)] = frame
        written += len(frame)
        return True

    if itemsize <= 1:
        for start in range(0, nbytes, SCRATCH_BYTES):
            if not put(compressor.compress(data[start : start + SCRATCH_BYTES])):
                return None
    else:
        source = np.frombuffer(data, dtype=np.uint8).reshape(-1, itemsize)
        scratch = np.empty(min(SCRATCH_BYTES, len(source)), dtype=np.uint8)
        for byte in range(itemsize):  # plane ``byte`` of the shuffled stream, a block at a time
            for start in range(0, len(source), len(scratch)):
                block = scratch[: min(len(scratch), len(source) - start)]
                np.copyto(block, source[start : start + len(block), byte])
                if not put(compressor.compress(block.data)):
                    return None
    return written if put(compressor.flush()) else None


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


def check_frame(frame: memoryview | bytes, nbytes: int) -> None:
    """ValueError unless ``frame``'s header says it holds exactly ``nbytes`` (read before
    anything is allocated for it or decompressed)."""
    try:
        size = zstandard.get_frame_parameters(frame).content_size
    except zstandard.ZstdError as exc:
        raise ValueError(f"not a valid zstd frame: {exc}") from None
    if size != nbytes:
        held = "an unknown number of" if size == zstandard.CONTENTSIZE_UNKNOWN else str(size)
        raise ValueError(f"the frame's header says it holds {held} bytes, the range {nbytes}")


def decompress_into(frame: memoryview, dest: memoryview, itemsize: int) -> None:
    """Decompress ``frame`` into ``dest`` (exactly its size), unshuffling by ``itemsize``
    through one scratch buffer of its size; ValueError if the frame's header or its content
    does not hold exactly that many bytes (the header is checked first)."""
    check_frame(frame, dest.nbytes)
    if itemsize <= 1:
        _inflate(frame, dest)
        return
    scratch = memoryview(bytearray(dest.nbytes))
    _inflate(frame, scratch)
    unshuffle_into(scratch, dest, itemsize)
