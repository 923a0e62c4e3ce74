"""Byte counts and rates for people: one convention everywhere (messages, events, the CLI).

Binary units, as the configuration's own sizes are usually written (``512MiB``): B, KiB, MiB,
GiB, TiB, and rates in the same units per second. Pure code.
"""

from __future__ import annotations

import math

__all__ = ["format_bytes", "format_rate"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(nbytes: float) -> str:
    """``65536`` -> ``"64 KiB"``, ``1536`` -> ``"1.5 KiB"``, ``72`` -> ``"72 B"``; a count
    that would read 1024.0 of a unit is 1 of the next (``1048575`` -> ``"1 MiB"``); ``inf``
    and ``nan`` are shown as they are."""
    value = float(nbytes)
    if not math.isfinite(value):
        return f"{value} B"
    for unit in _UNITS:
        shown = round(value) if unit == "B" else round(value, 1)
        if abs(shown) < 1024 or unit == _UNITS[-1]:
            return f"{shown:.0f} {unit}" if shown == int(shown) else f"{shown:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_rate(bytes_per_second: float) -> str:
    """``3 * 2**30`` -> ``"3 GiB/s"``."""
    return f"{format_bytes(bytes_per_second)}/s"
