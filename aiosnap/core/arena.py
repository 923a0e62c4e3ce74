"""The staging arena: one memory region cut into equal slabs, resident only where used.

Captured chunks are copied into slabs of the arena; the transfer side reads them from
there. In ``upload.executor: process`` mode the region is a memfd that both processes map
(one file descriptor, one mapping, whatever the number of tensors); in thread mode it is
anonymous memory. The whole region is reserved when the checkpointer starts, at the RAM
budget's size, but reserving costs address space only: a page takes memory when a capture
(or a load) first writes it, and the slab pool lends the lowest free slab first, so the
resident part is what the saves have needed at once, never more than the budget. Growing
needs no remapping: the upload process maps the same memfd, whose pages are the trainer's.
No torch here: the upload process maps it without torch.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import weakref

__all__ = ["Arena", "SlabLease"]

log = logging.getLogger("aiosnap")


class Arena:
    """``count`` slabs of ``slab_bytes`` each, contiguous, in one mapping (reserved, not
    resident: see the module docstring)."""

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
            os.ftruncate(self._fd, self.size)  # a sparse file: no page is allocated yet
            self._map = mmap.mmap(self._fd, self.size)
        else:
            self._map = mmap.mmap(-1, self.size)
        self.buffer = memoryview(self._map)

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

    def close(self) -> None:
        """Unmap (and close the memfd); idempotent. Views must not be used afterwards."""
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
