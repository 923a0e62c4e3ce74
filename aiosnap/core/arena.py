"""The staging arena: one memory region, allocated once, cut into equal slabs.

Captured chunks are copied into slabs of the arena; the transfer side reads them from
there. In ``upload.executor: process`` mode the region is a memfd that both processes map
(one file descriptor, one mapping, whatever the number of tensors); in thread mode it is
anonymous memory. The whole arena is counted in the RAM budget (it is the RAM budget) and
its pages are touched in the background when it is made, so the first save copies into
memory that is already there. No torch here: the upload process maps it without torch.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Arena", "SlabLease"]

log = logging.getLogger("aiosnap")

_PREWARM_STEP = 16 * 1024 * 1024  # a capture waits for at most one step

_POPULATE_WRITE: int | None = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform == "linux" else None)
"""madvise(MADV_POPULATE_WRITE) (Linux 5.14+; Python names it from 3.12): fault pages in,
writable, without touching what they hold -- a capture may be filling them meanwhile."""


_libc: ctypes.CDLL | None = None


def _madvise(address: int, length: int, advice: int) -> bool:
    """libc ``madvise`` through ctypes, which lets go of the GIL for the call (``mmap.madvise``
    holds it: populating 16 MiB would stall every Python thread, the trainer's included, for
    milliseconds). False when the kernel refuses the advice."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return bool(_libc.madvise(address, length, advice) == 0)


class Arena:
    """``count`` slabs of ``slab_bytes`` each, contiguous, in one mapping."""

    def __init__(self, slab_bytes: int, count: int, *, shared: bool, fd: int | None = None) -> None:
        if slab_bytes <= 0 or count <= 0:
            raise ValueError(f"an arena needs slabs: {count} x {slab_bytes} bytes")
        self.slab_bytes = slab_bytes
        self.count = count
        self.size = slab_bytes * count
        self.shared = shared
        self._fd: int | None = None
        if fd is not None:  # the upload process attaching to the trainer's arena
            self._map = mmap.mmap(fd, self.size)
            os.close(fd)
        elif shared:
            self._fd = os.memfd_create("aiosnap-staging", os.MFD_CLOEXEC)
            os.ftruncate(self._fd, self.size)
            self._map = mmap.mmap(self._fd, self.size)
        else:
            self._map = mmap.mmap(-1, self.size)
        self.buffer = memoryview(self._map)
        self._prewarm: threading.Thread | None = None
        self._stop = threading.Event()
        self._quiet = threading.Event()  # clear while a capture runs: the prewarm waits
        self._quiet.set()
        self._captures = 0

    @property
    def fd(self) -> int:
        """The memfd to hand to the upload process (shared arenas only)."""
        if self._fd is None:
            raise ValueError("this arena is not shared")
        return self._fd

    def view(self, slab: int, nbytes: int | None = None) -> memoryview:
        """The first ``nbytes`` (all by default) of slab ``slab``, without a copy."""
        if not 0 <= slab < self.count:
            raise IndexError(f"slab {slab} is not in this arena of {self.count}")
        start = slab * self.slab_bytes
        return self.buffer[start : start + (self.slab_bytes if nbytes is None else nbytes)]

    def lease(self, slab: int, nbytes: int) -> SlabLease:
        """The first ``nbytes`` of slab ``slab`` for a consumer that may keep views of it
        beyond its own return (a socket's write buffer): see :class:`SlabLease`."""
        return SlabLease(self.view(slab, nbytes))

    def prewarm(self) -> None:
        """Touch every page on a background thread, slab 0 first (the order the pool lends
        them), so the pages are resident before the first save needs them; returns at once.
        It pauses while a capture runs (:meth:`capturing`): on a few cores the two would
        only slow each other down."""

        def touch() -> None:
            populate = _POPULATE_WRITE
            base = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))  # the export ends here
            try:
                for start in range(0, self.size, _PREWARM_STEP):
                    self._quiet.wait()
                    if self._stop.is_set():
                        return
                    length = min(_PREWARM_STEP, self.size - start)
                    if populate is not None:
                        if _madvise(base + start, length, populate):
                            continue
                        populate = None  # an older kernel
                    # Read, never write: a slab may hold a capture by now (the check above
                    # and a capture can cross), and a write would clobber it. A read fault
                    # makes a memfd's pages resident; anonymous memory gets the zero page,
                    # and its first write still faults (no gain there, no harm).
                    for page in range(start, start + length, mmap.PAGESIZE):
                        self.buffer[page]
            except (ValueError, OSError):  # closed meanwhile
                pass

        self._prewarm = threading.Thread(target=touch, name="aiosnap-prewarm", daemon=True)
        self._prewarm.start()

    def wait_resident(self, timeout: float | None = None) -> bool:
        """Block until the prewarm is over (True), or ``timeout`` seconds (False). Any thread."""
        thread = self._prewarm
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Around a capture (or a load): the prewarm waits meanwhile. Loop thread."""
        self._captures += 1
        self._quiet.clear()
        try:
            yield
        finally:
            self._captures -= 1
            if self._captures == 0:
                self._quiet.set()

    def close(self) -> None:
        """Unmap (and close the memfd); idempotent. Views must not be used afterwards."""
        if self._prewarm is not None:
            self._stop.set()  # at most one more step of touching
            self._quiet.set()
            self._prewarm.join()
            self._prewarm = None
        if self._map.closed:
            return
        self.buffer.release()
        try:
            self._map.close()
        except BufferError:  # a view is still alive (a torch tensor over it): leave it to the GC
            log.debug("aiosnap: staging arena still referenced; it is freed when collected")
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class SlabLease:
    """Bytes of a slab handed to code that may hold on to views of them (aiohttp and the
    event loop keep a memoryview of a request body in their write buffers, and a closed,
    still flushing connection can outlive the request that wrote it).

    The bytes are exported through an owner object of our own; every view derived from
    :attr:`view` keeps it alive, so once :meth:`release` has dropped ours,
    :attr:`in_use` says whether anything else still reads the slab. Any thread.
    """

    def __init__(self, view: memoryview) -> None:
        owner = (ctypes.c_char * view.nbytes).from_buffer(view)
        self.view: memoryview | None = memoryview(owner).cast("B")
        self._owner = weakref.ref(owner)

    def release(self) -> None:
        """Drop this lease's own view (callers drop theirs, slices included)."""
        if self.view is not None:
            self.view.release()
            self.view = None

    @property
    def in_use(self) -> bool:
        return self._owner() is not None
