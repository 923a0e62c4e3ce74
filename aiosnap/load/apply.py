"""Turning a manifest's tree back into Python values, and applying them to a live state.

Pure code (no I/O); runs on the caller's thread so ``load_state_dict()`` of modules,
optimizers and user objects runs where the caller expects it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ..core.cudaorder import CudaOrder
from ..core.stateful import is_stateful, restores_by_key
from ..core.tensorio import copyable
from ..errors import PickleNotAllowedError, StateMismatchError
from ..format.manifest import Manifest
from ..format.values import key_path
from .decode import TreeDecoder, is_skipped
from .fetch import ReadPlan
from .inplace import destinations, staged_destinations, tensor_paths
from .reshard import shard_targets
from .select import (
    check_keys_present,
    dict_node,
    entries_under,
    needed_for_state,
    read_keys_only,
    refuse_unavailable,
    saved_children,
    select_paths,
)
from .staged import stageable

__all__ = ["apply_state", "check_meta_targets", "check_pickles", "decode_tree", "key_decoder", "plan_read"]

_META = (
    "a tensor on the meta device has no memory to load into: materialise it first "
    "(module.to_empty(device=...)), or load() without a state and restore with load_state_dict(..., assign=True)"
)


def check_meta_targets(targets: Any) -> None:
    """Caller's thread, before anything is read: :class:`StateMismatchError` naming the
    tensors of ``targets`` (:func:`~aiosnap.load.inplace.target_tree`) on the meta device,
    which a load would otherwise leave unloaded without a word (``copy_`` into a meta
    tensor, and a module's ``load_state_dict`` into meta parameters, do nothing)."""
    found = [path for path, tensor in tensor_paths(targets) if tensor.is_meta]
    if found:
        shown = ", ".join(repr(p) for p in found[:5]) + (" ..." if len(found) > 5 else "")
        raise StateMismatchError(f"{shown}: {_META}")


def check_pickles(manifest: Manifest, allow_pickle: bool, only: set[int] | None = None) -> None:
    """Refuse early (before any data is read) a checkpoint holding pickled objects (among the
    entries ``only``, when a partial load reads no others) unless the caller opted in. The
    decoder enforces the same rule on every node it decodes."""
    pickled = [e.path for i, e in enumerate(manifest.entries) if e.kind == "pickle" and (only is None or i in only)]
    if pickled and not allow_pickle:
        shown = ", ".join(repr(p) for p in pickled[:5]) + (" ..." if len(pickled) > 5 else "")
        raise PickleNotAllowedError(
            f"step {manifest.step} holds {len(pickled)} pickled object(s) ({shown}); loading them "
            "can execute arbitrary code: pass allow_pickle=True only if you trust this checkpoint"
        )


def _decoder(manifest: Manifest, tensors: dict[int, torch.Tensor], allow_pickle: bool) -> TreeDecoder:
    return TreeDecoder(
        tensors.__getitem__,
        [e.kind for e in manifest.entries],
        [e.path for e in manifest.entries],
        allow_pickle=allow_pickle,
        where=f"step {manifest.step}",
    )


def decode_tree(
    manifest: Manifest, tensors: dict[int, torch.Tensor], *, allow_pickle: bool = False, paths: list[str] | None = None
) -> Any:
    """The saved state as new Python objects (Stateful values come back as state dicts);
    with ``paths``, only the parts they select (:func:`~aiosnap.load.select.select_paths`)."""
    decode = _decoder(manifest, tensors, allow_pickle)
    tree = manifest.tree if paths is None else select_paths(manifest.tree, paths, key_decoder(manifest, allow_pickle))
    return decode(tree)


def key_decoder(manifest: Manifest, allow_pickle: bool) -> TreeDecoder:
    """Decodes dict keys without any tensor (a key that is a tensor raises KeyError)."""
    return _decoder(manifest, {}, allow_pickle)


def plan_read(
    manifest: Manifest,
    state: dict[str, Any] | None,
    targets: Any,
    paths: list[str] | None,
    allow_pickle: bool,
    slab_bytes: int | None = None,
    caller: CudaOrder | None = None,
) -> ReadPlan:
    """What a load reads: the entries ``state`` restores, or ``paths`` selects (all when
    neither); with ``targets`` (:func:`~aiosnap.load.inplace.target_tree` of ``state``), which
    of them go straight into the caller's tensors, and (given the staging ``slab_bytes``)
    which are copied into them through staging slabs. Loop thread (it reads only keys and
    tensor metadata of the caller's objects)."""
    keys = key_decoder(manifest, allow_pickle)
    if paths is not None:
        selected = select_paths(manifest.tree, paths, keys)
        refuse_unavailable(selected)
        return ReadPlan(only=entries_under(selected))
    if state is None:
        refuse_unavailable(manifest.tree)
        return ReadPlan()
    only = needed_for_state(manifest.tree, state, keys, manifest.step, targets)
    into = {} if targets is None else destinations(manifest, targets, keys)
    shards = {} if targets is None else shard_targets(manifest, targets, keys)
    staged: dict[int, torch.Tensor] = {}
    if targets is not None and slab_bytes is not None:
        staged = staged_destinations(
            manifest, targets, keys, into, lambda index: stageable(manifest, index, slab_bytes)
        )
    if only is not None:
        into = {i: t for i, t in into.items() if i in only}
        shards = {i: t for i, t in shards.items() if i in only}
        staged = {i: t for i, t in staged.items() if i in only}
    return ReadPlan(only=only, into=into, shards=shards, staged=staged, caller=caller)


_BY_KEY = (
    "a checkpoint saved by pipeline stages (or ranks holding different keys) holds every stage's keys: restore a "
    "stage's part with aiosnap.ShardedState(model, optimizer), which loads the keys it holds"
)


def _load_state_dict(target: Any, value: Any, where: str) -> None:
    """``target.load_state_dict(value)``; torch's refusals of a state dict that does not fit
    a module or an optimizer become :class:`StateMismatchError` naming ``where``."""
    try:
        target.load_state_dict(value)
    except RuntimeError as exc:
        if not (isinstance(target, torch.nn.Module) and "Error(s) in loading state_dict" in str(exc)):
            raise
        raise StateMismatchError(f"{where}: {str(exc).strip()[:2000]}; {_BY_KEY}") from exc
    except ValueError as exc:
        if not isinstance(target, torch.optim.Optimizer) or isinstance(exc, StateMismatchError):
            raise
        raise StateMismatchError(f"{where}: {str(exc)[:2000]}; {_BY_KEY}") from exc


def apply_state(
    manifest: Manifest, tensors: dict[int, torch.Tensor], state: dict[str, Any], *, allow_pickle: bool = False
) -> None:
    """Restore into ``state`` in place: Stateful values get ``load_state_dict``, tensors are
    copied into, nested dicts are walked, other values are replaced. Every key of ``state``
    must be in the checkpoint; keys only in the checkpoint are left out."""
    _apply(_decoder(manifest, tensors, allow_pickle), tensors.__contains__, manifest.step, manifest.tree, state, "")


def _apply(
    decode: TreeDecoder, read: Callable[[int], bool], step: int, node: Any, target: dict[Any, Any], path: str
) -> None:
    inner = dict_node(node)
    if inner is None:
        raise StateMismatchError(f"{path or 'state'}: checkpoint holds no dict here to load into a dict")
    saved = saved_children(inner["items"], target, decode)
    check_keys_present(target, saved, step, path)
    for key, current in target.items():
        child = saved[key]
        if is_skipped(child):  # a rank-local value this load leaves as it is
            continue
        where = key_path(path, key)
        if restores_by_key(current):  # its own keys: what this load read of it (and plain values)
            current.load_state_dict(decode(read_keys_only(child, read)))
        elif is_stateful(current) and not isinstance(current, dict):
            _load_state_dict(current, decode(child), where)
        elif isinstance(current, torch.Tensor):
            if current.is_meta:
                raise StateMismatchError(f"{where}: {_META}")
            value = decode(child)
            if not isinstance(value, torch.Tensor):
                raise StateMismatchError(f"{where}: checkpoint holds {type(value).__name__}, state has a tensor")
            if value.shape != current.shape:
                raise StateMismatchError(
                    f"{where}: checkpoint shape {tuple(value.shape)} != state shape {tuple(current.shape)}"
                )
            same = value.dtype == current.dtype
            with torch.no_grad():  # read in place: the same memory, torch returns at once (and
                try:  # bumps the version counter, so autograd knows it changed)
                    (copyable(current) if same else current).copy_(copyable(value) if same else value)
                except NotImplementedError as exc:  # no conversion between these dtypes
                    raise StateMismatchError(
                        f"{where}: checkpoint {value.dtype} cannot be copied into the state's {current.dtype}"
                    ) from exc
        elif isinstance(current, dict) and dict_node(child) is not None:  # a Stateful's state dict too
            _apply(decode, read, step, child, current, where)
        else:
            target[key] = decode(child)
    if "meta" in inner and isinstance(target, OrderedDict):  # its version metadata, as saved
        target._metadata = decode(inner["meta"])  # type: ignore[attr-defined]
