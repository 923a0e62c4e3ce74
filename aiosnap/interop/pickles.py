"""Reading pickles other tools wrote (DCP's ``.metadata``, ``torch.save``'s ``data.pkl``)
without running them.

:func:`unpickle_restricted` resolves only the globals of an allow-list, and each of them to
a stand-in: a :class:`Record` class of the same name, whose instances keep what the pickle
gave them (the arguments of a call, the state of a ``BUILD``) and do nothing else. No class
or function of the allow-list is ever imported or called, so a crafted pickle (an
``os.system`` gadget, a ``__reduce__`` of anything) runs no code; what comes back is a graph
of plain values and records that the caller validates field by field
(:mod:`aiosnap.interop.dcp.metadata`, :mod:`aiosnap.interop.torchzip`). Every problem is a
:class:`~aiosnap.errors.CorruptCheckpointError` naming the file. Pure code, no torch; runs
on whichever thread calls.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import CorruptCheckpointError

__all__ = [
    "MAX_DEPTH",
    "NODES_PER_BYTE",
    "Record",
    "RecordType",
    "node_budget",
    "plain_value",
    "record_type",
    "unpickle_restricted",
]

MAX_DEPTH = 100
"""Deepest nesting a plain value taken from a pickle may have."""


class Record:
    """A stand-in for an instance of an allowed class, or the result of calling an allowed
    function: ``args`` (of the call or of ``NEWOBJ``), ``state`` (of ``BUILD``), and
    ``items`` (what ``SETITEM``/``APPEND`` put into it, for dict- or list-like classes)."""

    qualname: str = ""
    args: tuple[Any, ...]
    state: Any
    items: list[Any]

    def __new__(cls, *args: Any) -> Record:  # NEWOBJ calls __new__ alone; a call, both
        self = super().__new__(cls)
        self.args = args
        self.state = None
        self.items = []
        return self

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items.append((key, value))

    def append(self, value: Any) -> None:
        self.items.append(value)

    def extend(self, values: Iterable[Any]) -> None:
        self.items.extend(values)

    def __repr__(self) -> str:
        return f"<{self.qualname}>"


RecordType = type[Record]
_TYPES: dict[str, RecordType] = {}


def record_type(qualname: str) -> RecordType:
    """The stand-in class for the global ``qualname`` (``"module.name"``), one per name: a
    dtype such as ``torch.float32`` is its class itself, a call ``torch.Size((3, 4))`` an
    instance of it."""
    found = _TYPES.get(qualname)
    if found is None:
        found = _TYPES[qualname] = type(qualname.rsplit(".", 1)[-1], (Record,), {"qualname": qualname})
    return found


_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: set[str], persistent: Callable[[Any], Any] | None, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed
        self._persistent = persistent
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        qualname = f"{_PY2_MODULES.get(module, module)}.{name}"  # protocol 2 pickles name Python 2's modules
        if qualname not in self._allowed:
            raise CorruptCheckpointError(
                f"{self._where}: refers to {qualname[:200]!r}, which this kind of file never holds; not loading it "
                "(nothing of it was run)"
            )
        if qualname == "collections.OrderedDict":
            return OrderedDict
        return record_type(qualname)

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise CorruptCheckpointError(f"{self._where}: a persistent id, which this kind of file never holds")
        return self._persistent(pid)


def unpickle_restricted(
    data: bytes,
    allowed: set[str],
    where: str,
    *,
    persistent: Callable[[Any], Any] | None = None,
    limit: int,
) -> Any:
    """The object graph pickled in ``data`` (read from ``where``), with the globals in
    ``allowed`` as :class:`Record` stand-ins (``collections.OrderedDict`` as itself) and
    persistent ids passed to ``persistent``. Anything else -- another global, a malformed
    or truncated pickle, more than ``limit`` bytes -- is a CorruptCheckpointError."""
    if len(data) > limit:
        raise CorruptCheckpointError(f"{where}: {len(data)} bytes is too large for what it claims to be")
    try:
        return _Unpickler(data, allowed, persistent, where).load()
    except CorruptCheckpointError:
        raise
    except (Exception, RecursionError) as exc:  # pickle.UnpicklingError, EOFError, a record refusing an op...
        raise CorruptCheckpointError(f"{where}: not a readable pickle ({type(exc).__name__}: {exc})"[:500]) from None


_PLAIN = (type(None), bool, int, float, str, bytes)
NODES_BASE = 100_000
NODES_PER_BYTE = 8
"""Most values (containers and leaves) :func:`plain_value` rebuilds from a pickle of ``n``
bytes: ``NODES_BASE + NODES_PER_BYTE * n``. A pickle may refer to one container many times
(its memo), and the rebuilt tree repeats it each time: without a bound, a pickle of a
kilobyte (lists of ten references to one list, eight levels deep) would rebuild 10**8
values. An honest pickle spends at least a byte on each value it holds, so the bound leaves
room for a lot of sharing."""


def node_budget(nbytes: int) -> int:
    """How many values :func:`plain_value` may rebuild from a pickle of ``nbytes`` bytes."""
    return NODES_BASE + NODES_PER_BYTE * nbytes


class _Rebuilder:
    """One :func:`plain_value` call: where the pickle is from, and how many values it may
    still build."""

    def __init__(self, where: str, budget: int) -> None:
        self.where = where
        self.left = budget

    def value(self, value: Any, depth: int, leaf: Callable[[Any], Any] | None) -> Any:
        where = self.where
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError(f"{where}: nested more than {MAX_DEPTH} levels deep")
        self.left -= 1
        if self.left < 0:
            raise CorruptCheckpointError(
                f"{where}: holds more values than its size allows (containers referred to over and over)"
            )
        kind = type(value)
        if kind in _PLAIN:
            return value
        if kind is list:
            return [self.value(v, depth + 1, leaf) for v in value]
        if kind is tuple:
            return tuple(self.value(v, depth + 1, leaf) for v in value)
        if kind in (dict, OrderedDict):
            items = [(self.value(k, depth + 1, leaf), self.value(v, depth + 1, leaf)) for k, v in value.items()]
            try:
                rebuilt = kind(items)
            except TypeError as exc:  # an unhashable key
                raise CorruptCheckpointError(f"{where}: a dict key that cannot be one ({exc})") from None
            meta = getattr(value, "_metadata", None)  # a module's state dict keeps its version metadata
            if kind is OrderedDict and meta is not None:
                rebuilt._metadata = self.value(meta, depth + 1, None)  # type: ignore[attr-defined]
            return rebuilt
        if isinstance(value, (Record, type)) and leaf is not None:
            return leaf(value)
        name = value.qualname if isinstance(value, Record) else getattr(value, "qualname", type(value).__name__)
        raise CorruptCheckpointError(f"{where}: holds a {str(name)[:100]!r} where plain data was expected")


def plain_value(value: Any, where: str, leaf: Callable[[Any], Any] | None = None, *, budget: int) -> Any:
    """``value`` if it is plain data (None, bool, int, float, str, bytes, and lists, tuples,
    dicts and OrderedDicts of them, dict keys hashable), with each :class:`Record` handed to
    ``leaf`` (which returns what stands in its place, or raises); CorruptCheckpointError
    for anything else, for nesting deeper than :data:`MAX_DEPTH` and for more than
    ``budget`` values in all (see :data:`NODES_PER_BYTE`; :func:`node_budget` gives it for
    a pickle's size). Containers are rebuilt, so nothing of the pickle's own objects is
    shared with the result."""
    try:
        return _Rebuilder(where, budget).value(value, 0, leaf)
    except (RecursionError, MemoryError) as exc:
        raise CorruptCheckpointError(f"{where}: too large or too deep to read ({type(exc).__name__})") from None
