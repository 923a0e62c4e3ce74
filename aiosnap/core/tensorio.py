"""Byte-level access to tensors: zero-copy memoryviews and range copies.

Pure helpers with no event loop; the capture copier thread and the load path call them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import torch

from .checksums import crc32c_of

__all__ = [
    "bytes_view", "copy_range_into", "copyable", "host_address", "iter_row_major_views", "storage_holds",
    "value_crc32c", "write_constants",
]  # fmt: skip

_DEVICE_PIECE = 64 * 1024 * 1024
"""Bytes of a device tensor copied to host at a time by :func:`value_crc32c`."""


def bytes_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of the bytes of a contiguous CPU tensor (no copy).

    The view keeps the tensor alive for as long as the view (or a slice of it) exists.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("bytes_view needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    array._aiosnap_owner = tensor  # type: ignore[attr-defined]  # keeps the memory alive
    return memoryview(array).cast("B")


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_BYTES_ONLY = frozenset(
    dtype
    for kind in ("int", "uint")
    for bits in range(1, 8)
    if isinstance(dtype := getattr(torch, f"{kind}{bits}", None), torch.dtype)
)
"""Bit-packed dtypes (``torch.int1`` ... ``torch.uint7``, one byte each) that torch views but does
not copy ("copy_kernel not implemented"): copied as the bytes they are."""


def value_crc32c(tensor: torch.Tensor) -> int:
    """The CRC32C of ``tensor``'s values as a save stores them (its row-major bytes): what
    the crc32c of its byte ranges combine to once written. Runs on the calling thread; a
    device tensor is copied to host :data:`_DEVICE_PIECE` bytes at a time (and waited for)."""
    values = tensor.detach()
    if values.is_conj():
        values = values.resolve_conj()
    if values.is_neg():
        values = values.resolve_neg()
    if not values.is_contiguous():
        values = values.contiguous()
    if values.is_cpu and type(values) in _PLAIN_TYPES:
        return crc32c_of(bytes_view(values))
    raw = values.reshape(-1).view(torch.uint8)
    crc = 0
    for start in range(0, raw.numel(), _DEVICE_PIECE):
        crc = crc32c_of(bytes_view(raw[start : start + _DEVICE_PIECE].cpu()), crc)
    return crc


def host_address(tensor: torch.Tensor, nbytes: int) -> int:
    """Where the first ``nbytes`` of ``tensor``'s row-major bytes lie in host memory, as
    they are; 0 when they do not lie there plainly (a device tensor, a strided view, a lazy
    conjugate or negative view, a subclass other than Parameter, a tensor that no longer
    holds ``nbytes``, or whose storage no longer does: ``untyped_storage().resize_()``
    leaves the view as it was). Copying from this address is the same as copying its values."""
    if (
        type(tensor) not in _PLAIN_TYPES
        or not tensor.is_cpu
        or tensor.nbytes < nbytes
        or not tensor.is_contiguous()
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor._is_zerotensor()
    ):
        return 0
    address = int(tensor.data_ptr())
    storage = tensor.untyped_storage()  # ~1 us: the one check a copy by address needs
    if storage.data_ptr() + storage.nbytes() < address + nbytes:
        return 0
    return address


def copyable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or of a bit-packed dtype (:data:`_BYTES_ONLY`, which torch views but does not
    copy) its bytes as ``uint8``: what a copy between two tensors of one dtype copies."""
    return tensor.view(torch.uint8) if tensor.dtype in _BYTES_ONLY else tensor


def storage_holds(tensor: torch.Tensor, storage_nbytes: int | None = None) -> bool:
    """Whether ``tensor``'s storage (of ``storage_nbytes``, when known) holds every byte of
    its view: a storage resized smaller (``untyped_storage().resize_()``) does not, and
    reading the view would read memory that is not the tensor's."""
    if tensor.numel() == 0:
        return True
    if storage_nbytes is None:
        storage_nbytes = tensor.untyped_storage().nbytes()
    itemsize = tensor.element_size()
    if tensor.is_contiguous():
        return (tensor.storage_offset() + tensor.numel()) * itemsize <= storage_nbytes
    last = sum((size - 1) * step for size, step in zip(tensor.shape, tensor.stride(), strict=True))
    return (tensor.storage_offset() + last + 1) * itemsize <= storage_nbytes


def iter_row_major_views(tensor: torch.Tensor, start: int, stop: int) -> Iterator[torch.Tensor]:
    """Views of ``tensor`` that together cover elements ``[start, stop)`` in row-major order.

    Never copies: a contiguous tensor gives one flat slice; a strided one is walked
    along its leading dimension, whole rows grouped into one view where possible.
    """
    if start >= stop:
        return
    if tensor.is_contiguous():
        yield tensor.reshape(-1)[start:stop]
        return
    if tensor.dim() == 1:
        yield tensor[start:stop]
        return
    inner = tensor[0].numel()
    first, last = start // inner, (stop - 1) // inner
    row = first
    while row <= last:
        lo = max(start - row * inner, 0)
        hi = min(stop - row * inner, inner)
        if lo == 0 and hi == inner:
            end = row + 1  # extend over following whole rows
            while end <= last and stop - end * inner >= inner:
                end += 1
            yield tensor[row:end]
            row = end
        else:
            yield from iter_row_major_views(tensor[row], lo, hi)
            row += 1


def copy_range_into(
    dest: torch.Tensor, dest_offset: int, src: torch.Tensor, src_offset: int, nbytes: int, non_blocking: bool = False
) -> None:
    """Copy ``nbytes`` of ``src``'s row-major bytes from ``src_offset`` into the uint8 buffer
    ``dest`` at ``dest_offset``. Offsets and lengths are multiples of the element size."""
    src = copyable(src)
    itemsize = src.element_size()
    typed = dest[dest_offset : dest_offset + nbytes].view(src.dtype)
    first = src_offset // itemsize
    position = 0
    for view in iter_row_major_views(src.detach(), first, first + nbytes // itemsize):
        count = view.numel()
        typed[position : position + count].view(view.shape).copy_(view, non_blocking=non_blocking)
        position += count
    if position * itemsize != nbytes:
        raise RuntimeError(
            f"a tensor of {src.numel()} elements holds fewer than the {first + nbytes // itemsize} the save "
            "planned for: was it resized while save() ran?"
        )


def write_constants(dest: torch.Tensor, constants: list[tuple[int, bytes]]) -> None:
    """Write each ``(offset, data)`` into the contiguous CPU uint8 buffer ``dest`` (zip headers
    between a single-file save's tensors: many small writes, so straight to its memory)."""
    if dest.device.type != "cpu" or not dest.is_contiguous() or dest.dtype != torch.uint8:
        raise ValueError("write_constants needs a contiguous CPU uint8 buffer")
    size = dest.numel()
    base = dest.data_ptr()
    for offset, data in constants:
        if offset < 0 or offset + len(data) > size:
            raise ValueError(f"{len(data)} bytes at {offset} do not fit in a buffer of {size}")
        ctypes.memmove(base + offset, data, len(data))
