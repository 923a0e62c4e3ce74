"""What a manifest holds as plain JSON: the one definition the planner and the readers share.

A state's plain values (and a save's metadata) go into the manifest as JSON. The planner
(:mod:`aiosnap.trainer.plan`) puts a value there only when these rules say that a reader
takes it back exactly; the readers' validators (:mod:`.tree`, :mod:`.manifest`) refuse
anything else. A value outside them is pickled (when the checkpointer allows pickles) or
refused by ``save()`` on the caller's thread: never written into a manifest that a reader
then refuses. Pure code, no torch; any thread.
"""

from __future__ import annotations

import math
import re
import struct
from typing import Any

__all__ = [
    "DEVICE_TYPES",
    "MAX_DIM",
    "MAX_INT_DIGITS",
    "MAX_NDIM",
    "MAX_TREE_DEPTH",
    "check_metadata",
    "float_as_text",
    "float_text",
    "inline_int",
    "inline_str",
    "int_text",
    "json_int",
    "key_path",
    "key_text",
    "plain_device",
    "plain_size",
]

MAX_TREE_DEPTH = 200
"""Deepest nesting of JSON arrays and objects in a tree (or in the metadata), counted in
the JSON itself: a dict of the state takes three levels (its node, its items, a ``[key,
value]`` pair), a list or tuple two, a Stateful object's node one, a tensor's node one. So
a state holds dicts nested 66 deep, lists 100 deep. The one bound of the planner, the
readers' validators, the commit's serializer (pydantic's stops at 254 levels) and the spool
journal, with room for the few levels that wrap a tree in a manifest or journal record."""
MAX_INT_DIGITS = 4300
"""Most decimal digits of an int held inline: Python's JSON parser refuses longer ones by
default (``sys.get_int_max_str_digits``). Readers apply this bound whatever their process's
own setting, so that what one process writes every other reads."""
_INT_LIMIT: int = 10**MAX_INT_DIGITS
_DIGITS_AT_ONCE = 600
"""Digits converted by one ``int()``/``str()``: below the lowest limit a process may set
(640), so that conversions never depend on ``sys.set_int_max_str_digits``."""
_CHUNK = 10**_DIGITS_AT_ONCE
MAX_NDIM = 64
"""Most dimensions of a stored tensor."""
MAX_DIM = 2**62
"""Bound of a ``torch.Size`` item held inline."""

DEVICE_TYPES = (
    "cpu", "cuda", "mps", "xpu", "xla", "meta", "hpu", "mtia", "hip", "ipu", "maia", "privateuseone", "lazy", "ve",
    "vulkan", "fpga", "opengl", "opencl", "ideep",
)  # fmt: skip
_DEVICE = re.compile(rf"({'|'.join(DEVICE_TYPES)})(:[0-9]{{1,4}})?")


_NAN_BITS = struct.unpack("<Q", struct.pack("<d", math.nan))[0]
_NAN_TEXT = re.compile(r"nan:[0-9a-f]{16}")


def float_as_text(value: float) -> str:
    """A float as a tree's ``float`` node (and a ``complex`` node's parts) hold it, bit-exact:
    ``repr`` (``inf``, ``-0.0``), and a NaN other than ``float("nan")`` (another sign or
    payload) as ``nan:`` and its 16 hex digits."""
    if value == value:
        return repr(value)
    bits = struct.unpack("<Q", struct.pack("<d", value))[0]
    return "nan" if bits == _NAN_BITS else f"nan:{bits:016x}"


def float_text(value: Any) -> float:
    """The float of :func:`float_as_text`'s text; ValueError for anything else."""
    if not isinstance(value, str) or len(value) > 64:
        raise ValueError(f"expected a float as text, got {type(value).__name__}")
    if value.startswith("nan:"):
        if _NAN_TEXT.fullmatch(value) is None:
            raise ValueError(f"expected a NaN's bits, got {value!r}")
        found: float = struct.unpack("<d", struct.pack("<Q", int(value[4:], 16)))[0]
        if found == found:
            raise ValueError(f"{value!r} are not a NaN's bits")
        return found
    return float(value)


def inline_int(value: int) -> bool:
    """An int of at most :data:`MAX_INT_DIGITS` digits."""
    return bool(-_INT_LIMIT < value < _INT_LIMIT)


def inline_str(value: str) -> bool:
    """A str that JSON in UTF-8 holds: no lone surrogates (``os.listdir`` of names that are
    not UTF-8 gives such strings)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def plain_device(name: str) -> bool:
    """A device name a tree holds (``cpu``, ``cuda:1``; not ``mkldnn``)."""
    return _DEVICE.fullmatch(name) is not None


def plain_size(items: Any) -> bool:
    """Items of a ``torch.Size`` held inline: ints in ``[0, MAX_DIM)``."""
    return all(type(d) is int and 0 <= d < MAX_DIM for d in items)


def json_int(text: str) -> int:
    """``parse_int`` for ``json.loads``: the digit bound of :data:`MAX_INT_DIGITS`, whatever
    the process's own limit (``sys.set_int_max_str_digits``), in both directions: longer
    ints are refused, shorter ones read even where the process allows fewer digits."""
    negative = text.startswith("-")
    digits = text[1:] if negative else text
    if len(digits) > MAX_INT_DIGITS:
        raise ValueError(f"an int of {len(digits)} digits (more than {MAX_INT_DIGITS})")
    if len(digits) <= _DIGITS_AT_ONCE:
        return int(text)
    value = 0
    for start in range(0, len(digits), _DIGITS_AT_ONCE):
        piece = digits[start : start + _DIGITS_AT_ONCE]
        value = value * 10 ** len(piece) + int(piece)
    return -value if negative else value


def int_text(value: int) -> str:
    """``str(value)`` whatever the process's digit limit (``sys.set_int_max_str_digits``)."""
    if -_CHUNK < value < _CHUNK:
        return str(value)
    high, low = divmod(abs(value), _CHUNK)
    return ("-" if value < 0 else "") + int_text(high) + str(low).zfill(_DIGITS_AT_ONCE)


def key_text(key: Any) -> str:
    """A dict key as it appears in a path (``model/3/weight``): ``str(key)``, except that
    no key can make it fail (an int of any size, a key whose ``__str__`` raises) or grow
    past a bound (an int of more than :data:`MAX_INT_DIGITS` digits). The planner and the
    loaders name paths with it alike."""
    kind = type(key)
    if kind is str:
        return str(key)
    if kind is int:
        return int_text(key) if inline_int(key) else f"<an int of {key.bit_length()} bits>"
    try:
        return str(key)
    except Exception:
        return f"<a {kind.__name__}>"


def key_path(path: str, key: Any) -> str:
    """The path of ``key`` in the dict at ``path`` (``path/key``; the key alone at the top)."""
    text = key_text(key)
    return f"{path}/{text}" if path else text


def check_metadata(metadata: Any) -> None:
    """Raise ValueError (naming the key path) unless ``metadata`` is a dict that JSON gives
    back exactly: str keys; values None, bool, int (see :func:`inline_int`), finite float,
    str (see :func:`inline_str`), lists and dicts of such, nested at most
    :data:`MAX_TREE_DEPTH` levels. (A tuple would come back a list: it is refused.)"""
    if type(metadata) is not dict:
        raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}")
    pending: list[tuple[Any, str, int]] = [(metadata, "", 0)]
    while pending:
        value, path, depth = pending.pop()
        where = path or "metadata"
        kind = type(value)
        if value is None or kind is bool or (kind is float and math.isfinite(value)):
            continue
        if kind is int:
            if not inline_int(value):
                raise ValueError(f"{where}: an int of more than {MAX_INT_DIGITS} digits")
            continue
        if kind is str:
            if not inline_str(value):
                raise ValueError(f"{where}: a str that is not valid UTF-8 (lone surrogates)")
            continue
        if kind not in (dict, list):
            what = "a non-finite float" if kind is float else f"a {kind.__name__}"
            raise ValueError(f"{where}: {what} (metadata holds JSON values: None, bool, int, float, str, list, dict)")
        if depth >= MAX_TREE_DEPTH:
            raise ValueError(f"{where}: nested deeper than {MAX_TREE_DEPTH} levels")
        if kind is list:
            pending.extend((item, f"{path}/{index}", depth + 1) for index, item in enumerate(value))
            continue
        for key, item in value.items():
            if type(key) is not str or not inline_str(key):
                raise ValueError(f"{where}: the key {key_text(key)!r:.40} is not a str (JSON keys are)")
            pending.append((item, f"{path}/{key}" if path else key, depth + 1))
