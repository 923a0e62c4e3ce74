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
from typing import Any

__all__ = [
    "DEVICE_TYPES",
    "MAX_DIM",
    "MAX_INT_DIGITS",
    "MAX_NDIM",
    "MAX_TREE_DEPTH",
    "check_metadata",
    "inline_int",
    "inline_str",
    "json_int",
    "plain_device",
    "plain_size",
]

MAX_TREE_DEPTH = 100
"""Deepest nesting of containers a tree (or the metadata) may have."""
MAX_INT_DIGITS = 4300
"""Most decimal digits of an int held inline: Python's JSON parser refuses longer ones by
default (``sys.get_int_max_str_digits``). Readers apply this bound whatever their process's
own setting, so that what one process writes every other reads."""
_INT_LIMIT: int = 10**MAX_INT_DIGITS
MAX_NDIM = 64
"""Most dimensions of a stored tensor."""
MAX_DIM = 2**62
"""Bound of a ``torch.Size`` item held inline."""

DEVICE_TYPES = (
    "cpu", "cuda", "mps", "xpu", "xla", "meta", "hpu", "mtia", "hip", "ipu", "maia", "privateuseone", "lazy", "ve",
    "vulkan", "fpga", "opengl", "opencl", "ideep",
)  # fmt: skip
_DEVICE = re.compile(rf"({'|'.join(DEVICE_TYPES)})(:[0-9]{{1,4}})?")


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
    the process's own limit."""
    if len(text) - text.startswith("-") > MAX_INT_DIGITS:
        raise ValueError(f"an int of {len(text)} digits (more than {MAX_INT_DIGITS})")
    return int(text)


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
                raise ValueError(f"{where}: the key {key!r:.40} is not a str (JSON keys are)")
            pending.append((item, f"{path}/{key}" if path else key, depth + 1))
