"""Reading an untrusted JSON document one member at a time, so that what it costs is bounded
by its shape, not by what a hostile writer packs into it.

``json.loads`` of a whole document builds every value before anything can be checked: a
30 MiB header of empty lists becomes a gigabyte of Python objects. The safetensors header
and index have a fixed shape (one object whose members are small objects, or strings), so
their readers walk the outer object themselves (:func:`walk_object`), read each member's
value with a parser that cannot go past a small window (:func:`read_small_value`) or as a
plain string (:func:`read_string`), check it and keep only what they need. A document that
does not have that shape fails at its first wrong byte. Every problem is a ValueError whose
message says where; the callers name the file. Pure code; runs on whichever thread calls.
"""

from __future__ import annotations

import json
import json.decoder
import re
from collections.abc import Callable
from typing import Any

__all__ = ["expect_end", "read_small_value", "read_string", "skip_space", "walk_object"]

_SPACE = re.compile(r"[ \t\n\r]*")
_SPACE_CHARS = {" ", "\t", "\n", "\r"}
_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise ValueError(f"key {key!r:.80} appears twice")
        found[key] = value
    return found


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates)
_scanstring: Callable[[str, int, bool], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
"""The C string scanner ``json`` itself uses (not in the typing stubs)."""


def skip_space(text: str, pos: int) -> int:
    """The position of the first non-whitespace character at or after ``pos``."""
    if text[pos : pos + 1] not in _SPACE_CHARS:
        return pos
    match = _SPACE.match(text, pos)
    return match.end() if match is not None else pos


def _expect(text: str, pos: int, char: str) -> int:
    if text[pos : pos + 1] == char:
        return pos + 1
    pos = skip_space(text, pos)
    if not text.startswith(char, pos):
        found = text[pos : pos + 1] or "the end"
        raise ValueError(f"expected {char!r} at character {pos}, found {found!r}")
    return pos + 1


def _checked(value: str) -> str:
    """``value``, which must encode as UTF-8: a lone surrogate (``"\\ud800"``) does not."""
    if _SURROGATE.search(value):
        raise ValueError(f"{value!r:.80} holds a lone surrogate (not UTF-8 text)")
    return value


def read_string(text: str, pos: int) -> tuple[str, int]:
    """The JSON string at ``pos`` (after whitespace) and the position after it; its text
    must be UTF-8 (no lone surrogates) and hold no raw control characters."""
    pos = _expect(text, pos, '"')
    value, end = _scanstring(text, pos, True)
    if not value.isascii():
        _checked(value)
    return value, end


def read_small_value(text: str, pos: int, limit: int) -> tuple[Any, int]:
    """The JSON value at ``pos`` (after whitespace), which must fit in ``limit`` characters
    (so parsing it allocates little, whatever follows), and the position after it.
    Objects' keys must be unique. Strings in it are not checked for lone surrogates: the
    caller compares what it uses with the values it knows."""
    pos = skip_space(text, pos)
    window = text[pos : pos + limit]
    try:
        value, length = _DECODER.raw_decode(window)
    except json.JSONDecodeError as exc:
        if len(window) == limit:
            raise ValueError(f"the value at character {pos} is not valid JSON of at most {limit} characters") from None
        raise ValueError(f"invalid JSON at character {pos + exc.pos}: {exc.msg}") from None
    return value, pos + length


def walk_object(text: str, pos: int, read_member: Callable[[str, int], int]) -> int:
    """Walk the JSON object at ``pos`` (after whitespace): ``read_member(key, position of
    its value)`` reads each member's value and returns the position after it. Keys must be
    unique. Returns the position after the object."""
    pos = _expect(text, pos, "{")
    keys: set[str] = set()
    pos = skip_space(text, pos)
    if text.startswith("}", pos):
        return pos + 1
    while True:
        key, pos = read_string(text, pos)
        if key in keys:
            raise ValueError(f"key {key!r:.80} appears twice")
        keys.add(key)
        pos = read_member(key, _expect(text, pos, ":"))
        if text[pos : pos + 1] != ",":
            pos = skip_space(text, pos)
            if not text.startswith(",", pos):
                return _expect(text, pos, "}")
        pos += 1


def expect_end(text: str, pos: int) -> None:
    """Nothing but whitespace follows ``pos``."""
    pos = skip_space(text, pos)
    if pos != len(text):
        raise ValueError(f"unexpected {text[pos : pos + 20]!r} after the JSON object at character {pos}")
