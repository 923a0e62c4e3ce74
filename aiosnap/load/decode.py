"""Decoding a checked tree (:mod:`aiosnap.format.tree`) into Python values and tensors.

The decoder enforces the pickle opt-in itself: a tree that names a pickle is refused
unless the caller allowed pickles, whatever the entry table says. Runs on the caller's
thread.
"""

from __future__ import annotations

import base64
import pickle
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.tensorio import bytes_view
from ..errors import ManifestError, PickleNotAllowedError, StateMismatchError
from ..format.dtypes import dtype_itemsize
from ..format.tree import float_text
from .select import UNAVAILABLE

__all__ = ["TreeDecoder", "is_skipped", "torch_dtype"]


def is_skipped(node: Any) -> bool:
    """A rank-local value the load skips (see :mod:`aiosnap.load.ranks`): left out."""
    return isinstance(node, dict) and node.get("t") == "skipped"


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; ValueError for anything that is not a dtype."""
    dtype_itemsize(name)
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} does not exist in this torch")
    return dtype


class TreeDecoder:
    """Turns a checked tree back into Python values. ``tensor_of(index)`` gives an entry's
    tensor; pickle nodes are unpickled only when ``allow_pickle`` is true (else
    :class:`PickleNotAllowedError`), and only for entries of kind ``pickle``."""

    def __init__(
        self,
        tensor_of: Callable[[int], torch.Tensor],
        entry_kinds: Sequence[str],
        entry_paths: Sequence[str],
        *,
        allow_pickle: bool,
        where: str,
    ) -> None:
        self.tensor_of = tensor_of
        self.kinds = entry_kinds
        self.paths = entry_paths
        self.allow_pickle = allow_pickle
        self.where = where

    def __call__(self, node: Any) -> Any:
        try:
            return self._decode(node)
        except (PickleNotAllowedError, ManifestError):
            raise
        except (KeyError, IndexError, TypeError, ValueError, OverflowError, AttributeError, RecursionError) as exc:
            raise ManifestError(f"{self.where}: malformed tree: {type(exc).__name__}: {exc}") from exc

    def _entry(self, node: dict[str, Any], kind: str) -> int:
        index = node["id"]
        if type(index) is not int or not 0 <= index < len(self.kinds) or self.kinds[index] != kind:
            raise ManifestError(f"{self.where}: a {kind} node names entry {index!r:.20}, which is not a {kind}")
        return index

    def _decode(self, node: Any) -> Any:
        if node is None or type(node) in (bool, int, float, str):
            return node
        if not isinstance(node, dict) or "t" not in node:
            raise ManifestError(f"{self.where}: malformed tree node {node!r:.80}")
        tag = node["t"]
        if tag == UNAVAILABLE:
            raise StateMismatchError(str(node["why"]))
        if tag == "tensor":
            return self.tensor_of(self._entry(node, "tensor"))
        if tag == "dtensor":
            return self.tensor_of(self._entry(node, "sharded"))
        if tag == "pickle":
            index = self._entry(node, "pickle")
            if not self.allow_pickle:
                raise PickleNotAllowedError(
                    f"{self.where} holds a pickled object ({self.paths[index]!r}); loading it can execute "
                    "arbitrary code: pass allow_pickle=True only if you trust this checkpoint"
                )
            blob = bytes(bytes_view(self.tensor_of(index)))
            return pickle.loads(blob)  # noqa: S301 - the caller opted in
        if tag in ("dict", "odict"):
            items = [(self._decode(k), self._decode(v)) for k, v in node["items"] if not is_skipped(v)]
            if tag == "dict":
                return dict(items)
            ordered: OrderedDict[Any, Any] = OrderedDict(items)
            if "meta" in node:  # a module's state dict carries its version metadata
                ordered._metadata = self._decode(node["meta"])  # type: ignore[attr-defined]
            return ordered
        if tag == "list":
            return [None if is_skipped(v) else self._decode(v) for v in node["items"]]
        if tag == "tuple":
            return tuple(self._decode(v) for v in node["items"])
        if tag == "stateful":
            return self._decode(node["v"])
        if tag == "float":
            return float_text(node["v"])
        if tag == "size":
            return torch.Size(node["items"])
        if tag == "dtype":
            return torch_dtype(node["v"])
        if tag == "device":
            return torch.device(node["v"])
        if tag == "bytes":
            return base64.b64decode(node["v"], validate=True)
        if tag == "complex":
            return complex(float_text(node["v"][0]), float_text(node["v"][1]))
        raise ManifestError(f"{self.where}: unknown tree node type {tag!r:.40}")
