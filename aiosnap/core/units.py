"""Byte counts and rates for people: one convention everywhere (messages, events, the CLI).

Binary units, as the configuration's own sizes are usually written (``512MiB``): B, KiB, MiB,
GiB, TiB, and rates in the same units per second. Pure code.
"""

from __future__ import annotations

__all__ = ["format_bytes", "format_rate"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(nbytes: float) -> str:
    """``65536`` -> ``"64 KiB"``, ``1536`` -> ``"1.5 KiB"``, ``72`` -> ``"72 B"``."""
    value = float(nbytes)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            if unit == "B" or value == int(value):
                return f"{value:.0f} {unit}"
            return f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_rate(bytes_per_second: float) -> str:
    """``3 * 2**30`` -> ``"3 GiB/s"``."""
    return f"{format_bytes(bytes_per_second)}/s"
