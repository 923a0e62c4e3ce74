"""The dtypes a manifest may name, with their element sizes, without importing torch.

Manifests are validated (and the upload process builds them) without torch; the load side
turns a name into a ``torch.dtype`` (:func:`aiosnap.load.decode.torch_dtype`). A test keeps
this table equal to torch's own.
"""

from __future__ import annotations

__all__ = ["DTYPE_ITEMSIZE", "dtype_itemsize"]

DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
    "uint1": 1, "uint2": 1, "uint3": 1, "uint4": 1, "uint5": 1, "uint6": 1, "uint7": 1,
    "int1": 1, "int2": 1, "int3": 1, "int4": 1, "int5": 1, "int6": 1, "int7": 1,
    "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
}  # fmt: skip
"""Canonical names (``str(torch.float32)`` without ``torch.``) -> bytes per element."""


def dtype_itemsize(name: str) -> int:
    """Bytes per element of the dtype called ``name``; ValueError for anything else."""
    size = DTYPE_ITEMSIZE.get(name) if isinstance(name, str) else None
    if size is None:
        raise ValueError(f"unknown dtype {name!r:.40}")
    return size
