"""Flattening a state into a manifest's tree and a table of entries (caller's thread).

The tree is JSON: plain values inline, containers and other values as tagged nodes (see
:mod:`aiosnap.format.tree`), tensors as references into the entry table. What may be inline
is decided by :mod:`aiosnap.format.values`, the same rules the readers' validators apply:
a value outside them (a ``set``, a ``numpy.str_``, a str-``Enum``, a str with lone
surrogates, an int of more than 4,300 digits, ``torch.Size([-1])``, ``torch.device("mkldnn")``,
a Stateful object as a dict key, your own classes) is pickled when the checkpointer allows
pickles, and otherwise named in the :class:`~aiosnap.errors.UnsupportedStateError` that
``save()`` raises. A tensor that cannot be stored (sparse, meta, quantized, more than
:data:`~aiosnap.format.values.MAX_NDIM` dimensions, smaller storage than its view) is refused.
Pure code, no I/O.
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Any

import torch

from ..core.stateful import is_stateful
from ..core.tensorio import storage_holds
from ..errors import UnsupportedStateError
from ..format.tree import HASHABLE_TAGS
from ..format.values import (
    MAX_NDIM,
    MAX_TREE_DEPTH,
    float_as_text,
    inline_int,
    inline_str,
    key_text,
    plain_device,
    plain_size,
)
from .chunks import Entry
from .dtensor import DTensorShard, dtensor_shards, is_dtensor
from .pickling import pickle_value

__all__ = ["Flattener", "view_key"]


def _plain_tensor_or_refuse(tensor: torch.Tensor, path: str) -> None:
    """Refuse tensors whose bytes are not plain host or device memory of their own."""
    kind = type(tensor).__name__
    if kind == "DTensor":
        raise UnsupportedStateError(
            f"{path}: a DTensor cannot be saved here (in a rank-local value, or in a single-file "
            "checkpoint); save it in the shared state of a multi-rank folder checkpoint"
        )
    if tensor.layout != torch.strided:
        raise UnsupportedStateError(f"{path}: {tensor.layout} tensors are not supported")
    if tensor.is_meta:
        raise UnsupportedStateError(f"{path}: meta tensors hold no data to save")
    if tensor.is_quantized:
        raise UnsupportedStateError(f"{path}: quantized tensors are not supported")
    try:
        tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        raise UnsupportedStateError(f"{path}: a {kind} has no storage of its own to save ({exc})") from exc
    if tensor.dim() > MAX_NDIM:
        raise UnsupportedStateError(f"{path}: a tensor of {tensor.dim()} dimensions (at most {MAX_NDIM} are stored)")
    if not storage_holds(tensor, tensor.untyped_storage().nbytes()):
        raise UnsupportedStateError(
            f"{path}: its storage holds {tensor.untyped_storage().nbytes()} bytes, fewer than its view of shape "
            f"{tuple(tensor.shape)} reaches (was the storage resized?)"
        )


def view_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Two tensors with one key are the same bytes (one view of one storage)."""
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tensor.shape,
        tensor.stride(),
        tensor.dtype,
        tensor.device,
    )


def _join(path: str, index: int) -> str:
    return f"{path}/{index}" if path else str(index)


def _text(value: str) -> str:
    """``value`` as JSON can hold it (an entry's path): lone surrogates escaped."""
    return value if inline_str(value) else value.encode("utf-8", "backslashreplace").decode("utf-8")


def _holds_stateful(key: Any) -> bool:
    """A dict key that is (or holds, in a tuple) a Stateful object: pickled, not its state dict."""
    if type(key) is tuple:
        return any(_holds_stateful(part) for part in key)
    return is_stateful(key) and not isinstance(key, (dict, list))


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


_STRIDED = torch.strided
_DEVICES: dict[torch.device, bool] = {}


class Flattener:
    """Flattens a state into a tree and an entry table. ``rank_local``: path patterns whose
    values are flattened apart (:attr:`local`), each leaving a ``rank_local`` node behind;
    ``dtensors``: DTensors are saved as their local shards (else refused); ``pickles``:
    values that only pickle can store are pickled (else listed in :attr:`refused`)."""

    def __init__(self, rank_local: Sequence[str] = (), *, dtensors: bool = True, pickles: bool = False) -> None:
        self.entries: list[Entry] = []
        self.keys: list[tuple[Any, ...] | None] = []  # each entry's view key (None: not a plain tensor)
        self._seen: dict[tuple[Any, ...], int] = {}
        self.by_id: dict[int, int] = {}  # id(tensor) -> entry, for the tensors met
        self.stateful_dicts: dict[int, Any] = {}  # id(Stateful) -> the state dict it gave
        self._depth = 0
        self._patterns = tuple(rank_local)
        self._dtensors = dtensors
        self._pickles = pickles
        self.refused: list[tuple[str, str]] = []
        """(path, what) of each value that would have been pickled, when pickles are not allowed."""
        self.text = 0
        """Characters of the str leaves and keys met (for the manifest's size: JSON may take up
        to six bytes for one, ``\u0001``)."""
        self.exact = 0
        """Bytes that ints and bytes (as base64) of the tree take in the manifest."""
        self.nodes = 0
        """Values encoded one by one (plain tensors in dicts are not counted here)."""
        self.table = 0
        """A bound of the bytes the entries' paths and dimensions take in the manifest."""
        self.nbytes = 0
        """Bytes of the entries, together."""
        self.shards: dict[int, DTensorShard] = {}  # entry -> its DTensor shard
        self.local: Flattener | None = None
        self.local_values: list[Any] = []  # one tree per rank_local node, ids into local.entries
        self.local_paths: list[str] = []  # where each rank_local node is

    def encode(self, value: Any, path: str) -> Any:
        """The node of ``value``, which sits inside ``self._depth`` JSON arrays and objects
        of the tree: each container counts its own levels before it descends, a leaf's node
        is checked at the bound (:data:`~aiosnap.format.values.MAX_TREE_DEPTH`, counted as
        the readers' validator counts it)."""
        if self._patterns and path and any(fnmatchcase(path, p) for p in self._patterns):
            self._fits(1, path)
            return self._rank_local(value, path)
        if type(value) is torch.Tensor:  # the common leaf first: states hold many tensors
            self._fits(1, path)
            return {"t": "tensor", "id": self._plain(value, path)}
        self.nodes += 1
        node = self._encode(value, path)
        if self._depth + 2 > MAX_TREE_DEPTH and type(node) is dict:  # a leaf's node at the bound
            self._fits(2 if node["t"] in ("complex", "size") else 1, path)
        return node

    def _fits(self, levels: int, path: str) -> None:
        """Refuse a node of ``levels`` JSON levels here, past the bound."""
        if self._depth + levels > MAX_TREE_DEPTH:
            raise UnsupportedStateError(
                f"{path or 'the state'}: nested deeper than {MAX_TREE_DEPTH} levels of JSON, the most a "
                "manifest holds (a dict takes three, a list or tuple two: dicts within dicts 66 deep, lists 100)"
            )

    def _inside(self, value: Any, path: str, levels: int) -> Any:
        """``value``'s node, ``levels`` deeper than the current node (its items)."""
        self._depth += levels
        try:
            return self.encode(value, path)
        finally:
            self._depth -= levels

    def _rank_local(self, value: Any, path: str) -> Any:
        if self.local is None:
            self.local = Flattener(dtensors=False, pickles=self._pickles)  # its values' trees start at 0
            self.local.refused = self.refused  # one list: save() names them all
        self.local_values.append(self.local.encode(value, path))
        self.local_paths.append(path)
        return {"t": "rank_local", "slot": len(self.local_values) - 1}

    def _encode(self, value: Any, path: str) -> Any:
        kind = type(value)
        if value is None or kind is bool:
            return value
        if kind is str:
            self.text += len(value)
            return value if inline_str(value) else self._pickled(value, path, "a str with lone surrogates")
        if kind is int:
            if inline_int(value):
                if not -(2**64) < value < 2**64:
                    self.exact += value.bit_length() // 3 + 1
                return value
            return self._pickled(value, path, "an int of more than 4300 digits")
        if kind is float:
            return value if math.isfinite(value) else {"t": "float", "v": float_as_text(value)}
        if isinstance(value, torch.Tensor):
            index = self._tensor(value, path)
            return {"t": "dtensor" if index in self.shards else "tensor", "id": index}
        if is_stateful(value) and not isinstance(value, (dict, list, tuple)):
            self._fits(1, path)
            state = self.stateful_dicts[id(value)] = value.state_dict()
            return {"t": "stateful", "v": self._inside(state, path, 1)}
        if kind is dict or kind is OrderedDict:
            self._fits(3 if value else 2, path)  # its node, its items, each [key, value]
            node: dict[str, Any] = {"t": "dict" if kind is dict else "odict", "items": self._items(value, path)}
            meta = getattr(value, "_metadata", None)
            if meta is not None:
                node["meta"] = self._inside(meta, path + "#_metadata", 1)
            return node
        if kind is list or kind is tuple:
            self._fits(2, path)  # its node, its items
            self._depth += 2
            try:
                items = [self.encode(v, _join(path, i)) for i, v in enumerate(value)]
            finally:
                self._depth -= 2
            return {"t": "list" if kind is list else "tuple", "items": items}
        if kind is torch.Size:
            if plain_size(value):
                return {"t": "size", "items": list(value)}
            return self._pickled(value, path, "a torch.Size with negative items")
        if isinstance(value, torch.dtype):
            return {"t": "dtype", "v": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            plain = _DEVICES.get(value)
            if plain is None:
                plain = _DEVICES[value] = plain_device(str(value))
            return {"t": "device", "v": str(value)} if plain else self._pickled(value, path, f"device {value}")
        if kind is bytes:
            self.exact += -(-len(value) // 3) * 4  # base64
            return {"t": "bytes", "v": base64.b64encode(value).decode("ascii")}
        if kind is complex:
            return {"t": "complex", "v": [float_as_text(value.real), float_as_text(value.imag)]}
        return self._pickled(value, path, None)

    def _items(self, mapping: dict[Any, Any], path: str) -> list[list[Any]]:
        """A dict's ``[key, value]`` pairs, encoded; plain tensors (most of a state's
        values) without a call to :meth:`encode` each."""
        prefix = f"{path}/" if path else ""
        self._depth += 3  # keys and values sit in [key, value] pairs of the items
        inline = not self._patterns and self._depth < MAX_TREE_DEPTH
        items = []
        try:
            for k, v in mapping.items():
                if type(k) is str and k.isascii():  # the common key
                    key: Any = k
                    where = f"{prefix}{k}" if prefix else k
                    self.text += len(k)
                else:
                    where = _text(prefix + key_text(k))
                    key = self._key(k, where)
                if inline and type(v) is torch.Tensor:
                    items.append([key, {"t": "tensor", "id": self._plain(v, where)}])
                else:
                    items.append([key, self.encode(v, where)])
        finally:
            self._depth -= 3
        return items

    def _key(self, key: Any, where: str) -> Any:
        """A dict key's node: inline when a reader can make it a key again, else pickled."""
        if type(key) is str:
            self.text += len(key)
            return key if inline_str(key) else self._pickled(key, where, "a key with lone surrogates")
        if _holds_stateful(key):
            return self._pickled(key, where, f"a key of type {_type_name(key)}")
        node = self.encode(key, where)
        if not _hashable(node):
            return self._pickled(key, where, f"a key of type {_type_name(key)}")
        return node

    def add_tensor(self, tensor: torch.Tensor, path: str) -> int:
        """The entry of a tensor the state holds outside its tree (a single file stores
        those in its tensors' attributes: see :func:`.archive_plan.attribute_tensors`);
        refused, naming ``path``, as a tensor of the state would be."""
        return self._tensor(tensor, path)

    def _tensor(self, tensor: torch.Tensor, path: str) -> int:
        if self._dtensors and is_dtensor(tensor):
            return self._dtensor(tensor, path)
        _plain_tensor_or_refuse(tensor, path)
        return self._plain(tensor, path)

    def _dtensor(self, tensor: torch.Tensor, path: str) -> int:
        """A DTensor's entries: one per box of its local shard (one box, but for rare
        ``_StridedShard`` layouts); the tree names the first, the others share its path."""
        first = len(self.entries)
        for shard in dtensor_shards(tensor, path):
            index = len(self.entries)
            self.shards[index] = shard
            _plain_tensor_or_refuse(shard.local, path)
            self.entries.append(
                Entry(index, path, "sharded", shard.local, shard.local.numel() * shard.local.element_size())
            )
            self._counted(path, tensor.dim() + shard.local.dim(), self.entries[-1].nbytes)
            self.keys.append(None)
        self.by_id[id(tensor)] = first
        return first

    def _plain(self, tensor: torch.Tensor, path: str) -> int:
        """A tensor's entry (a new one, or the one of the same view met before); refuses
        tensors whose bytes cannot be saved. The per-tensor path of every save: kept short."""
        if tensor.layout is not _STRIDED or tensor.is_meta or tensor.is_quantized:
            _plain_tensor_or_refuse(tensor, path)  # raises, naming what it is
        try:
            storage = tensor.untyped_storage()
            key = (
                storage.data_ptr(),
                tensor.storage_offset(),
                tensor.shape,
                tensor.stride(),
                tensor.dtype,
                tensor.device,
            )
        except (RuntimeError, NotImplementedError, TypeError):
            _plain_tensor_or_refuse(tensor, path)  # raises, naming what it is
            raise
        nbytes = tensor.nbytes
        if len(key[2]) > MAX_NDIM or key[1] * tensor.element_size() + nbytes > storage.nbytes():
            # too many dimensions, or a storage resized smaller than the view (FSDP frees its
            # parameters' storages so); a strided view reaching past a storage that still holds
            # numel elements is caught when its bytes are copied (see trainer.capture)
            _plain_tensor_or_refuse(tensor, path)  # raises, naming what it is
        # The same view twice (tied weights) is stored once; not a lazy conjugate or negative
        # view, whose values differ from its memory's (and from the plain view's).
        lazy = tensor.is_conj() or tensor.is_neg()
        index = self._seen.get(key) if nbytes and not lazy else None
        if index is None:
            index = len(self.entries)
            self.entries.append(Entry(index, path, "tensor", tensor, nbytes))
            self.table += len(path) * 6 + len(key[2]) * 42
            self.nbytes += nbytes
            self.keys.append(key)
            if not lazy:
                self._seen[key] = index
        self.by_id[id(tensor)] = index
        return index

    def _counted(self, path: str, dims: int, nbytes: int) -> None:
        """Count a new entry for the manifest's size (see :attr:`table`)."""
        self.table += len(path) * 6 + dims * 42
        self.nbytes += nbytes

    def entry_of(self, tensor: torch.Tensor) -> int | None:
        """The entry of a tensor met while flattening (or the same view of it), else None."""
        index = self.by_id.get(id(tensor))
        if (
            index is None
            and tensor.numel() > 0
            and tensor.layout == torch.strided
            and not (tensor.is_meta or tensor.is_conj() or tensor.is_neg())
        ):
            index = self._seen.get(view_key(tensor))
        return index

    def _pickled(self, value: Any, path: str, what: str | None) -> dict[str, Any]:
        """The node of a value only pickle can store: a pickle entry, or (pickles not
        allowed) a placeholder, the value listed in :attr:`refused`."""
        if not self._pickles:
            self.refused.append((path or "/", what or f"a {_type_name(value)}"))
            return {"t": "pickle", "id": -1}
        try:
            blob = pickle_value(value)
        except Exception as exc:
            raise UnsupportedStateError(f"{path}: {type(value).__name__} cannot be saved: {exc}") from exc
        data = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
        index = len(self.entries)
        self.entries.append(Entry(index, path, "pickle", data, len(blob)))
        self._counted(path, 1, len(blob))
        self.keys.append(None)
        return {"t": "pickle", "id": index}


def _hashable(node: Any) -> bool:
    """Whether the value ``node`` decodes to can be a dict key (as the readers' validator
    decides: :func:`aiosnap.format.tree.check_tree`)."""
    if not isinstance(node, dict):
        return True
    tag = node.get("t")
    if tag == "tuple":
        return all(_hashable(item) for item in node["items"])
    return tag in HASHABLE_TAGS
