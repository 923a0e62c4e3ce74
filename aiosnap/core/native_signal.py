"""Signal dispositions Python cannot see: a handler installed from C with ``sigaction(2)``
(an MPI runtime, a native launcher, ``faulthandler.register``), which ``signal.getsignal``
reports as ``SIG_DFL`` (or None) and ``signal.signal`` cannot put back.

:func:`native_disposition` reads a signal's disposition as the C library holds it, as raw
bytes, when it is not what Python believes; :func:`restore_native` writes those bytes back.
The bytes go back untouched, so nothing is assumed of ``struct sigaction`` but that it fits
in :data:`_SIZE` bytes and that its handler is its first field (Linux with glibc or musl,
macOS); where there is no C library to ask (Windows), both do nothing. Main thread (where
``signal.signal`` runs). No torch.
"""

from __future__ import annotations

import ctypes
import functools
import signal
from typing import Any

__all__ = ["native_disposition", "restore_native"]

_SIZE = 1024
"""Bytes read and written back: more than any ``struct sigaction`` (152 with glibc on x86-64)."""


@functools.cache
def _sigaction() -> Any | None:
    """The C library's ``sigaction``, or None where there is none."""
    try:
        function = ctypes.CDLL(None).sigaction
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function


def native_disposition(signum: signal.Signals, python_view: object) -> bytes | None:
    """The raw disposition of ``signum`` when it differs from ``python_view`` (what
    ``signal.getsignal`` says: ``SIG_DFL``, ``SIG_IGN`` or None), that is, when a handler
    was installed from C; None when Python's view is the truth (a Python handler included:
    ``signal.signal`` puts that one back itself)."""
    if callable(python_view):
        return None
    sigaction = _sigaction()
    if sigaction is None:
        return None
    raw = ctypes.create_string_buffer(_SIZE)
    if sigaction(int(signum), None, raw) != 0:
        return None
    handler = ctypes.c_void_p.from_buffer(raw).value or 0
    expected = int(signal.SIG_IGN) if python_view == signal.SIG_IGN else int(signal.SIG_DFL)
    return None if handler == expected else raw.raw


def restore_native(signum: signal.Signals, raw: bytes) -> None:
    """Put back a disposition read by :func:`native_disposition` (after ``signal.signal``
    has put back Python's view of it)."""
    sigaction = _sigaction()
    if sigaction is not None:
        sigaction(int(signum), ctypes.create_string_buffer(raw, _SIZE), None)
