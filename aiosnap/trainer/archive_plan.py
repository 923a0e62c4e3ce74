"""Planning a save as one ``torch.load``-readable file (see :mod:`aiosnap.format.archive`).

Pure code on the caller's thread inside ``save()``. Two parts:

- :func:`layout_archive` lays the entries out in the file: chunks are consecutive byte
  ranges of it, each starting at a multiple of ``ALIGN``; before each entry's bytes, a
  zip local header (a constant the copier writes into the slab with the tensor bytes).
- :func:`torch_pickle` pickles the state as ``torch.save`` would (protocol 2, tensors
  rebuilt by ``torch._utils._rebuild_tensor_v2`` from storages named by persistent ids),
  except that each storage is the tensor's own bytes in row-major order -- what aiosnap
  stores -- so every tensor is rebuilt contiguous at offset 0. Tensors seen twice (tied
  weights) share one storage, as with ``torch.save``, and keep their Python attributes.
  Stateful values of the state are pickled as their state dict (an ``OrderedDict``, with
  its attributes: a module's ``_metadata``), at the state's own value positions only;
  anything else pickles as itself, as with ``torch.save`` (tensors inside it of dtypes
  without a legacy storage as :mod:`.pickling` reduces them; a Stateful object inside it
  as itself). Tensors held in a state tensor's Python attributes are entries of their own
  (:func:`attribute_tensors`), so that ``torch.load``'s ``weights_only`` reads them.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.serialization import location_tag

from ..core.stateful import is_stateful
from ..format.archive import ALIGN, data_record_name, local_header
from ..format.values import key_path, key_text
from .chunks import Chunk, Entry, Piece
from .pickling import LEGACY_STORAGES, check_storage, reduce_without_legacy_storage

__all__ = ["MIN_ARCHIVE_CHUNK_BYTES", "attribute_tensors", "layout_archive", "torch_pickle"]

MIN_ARCHIVE_CHUNK_BYTES = 4096
"""Smallest chunk an archive layout takes (a local header and some bytes must fit)."""


def layout_archive(entries: list[Entry], chunk_bytes: int, prefix: str) -> tuple[list[Chunk], list[int], int]:
    """Chunks of at most ``chunk_bytes`` covering the file from offset 0, each entry's local
    header right before its bytes (in the same chunk), every data start aligned. Returns the
    chunks, each entry's header offset in the file, and where the data ends (the tail's
    offset)."""
    if chunk_bytes < MIN_ARCHIVE_CHUNK_BYTES:
        raise ValueError(f"a single-file checkpoint needs chunks of at least {MIN_ARCHIVE_CHUNK_BYTES} bytes")
    chunks: list[Chunk] = []
    header_offsets: list[int] = []
    position = 0  # in the file
    current: Chunk | None = None
    start = 0  # the current chunk's offset in the file

    def close() -> None:
        nonlocal current, position
        if current is None:
            return
        pad = -position % ALIGN  # the next chunk starts aligned: zeros between records
        if pad:
            current.constants.append((position - start, bytes(pad)))
            position += pad
        current.nbytes = position - start
        current = None

    def open_chunk() -> Chunk:
        nonlocal current, start
        close()
        start = position
        current = Chunk(len(chunks), f"{prefix}/{len(chunks)}.bin")
        chunks.append(current)
        return current

    for entry in entries:
        name = data_record_name(entry.index)
        header = local_header(name, entry.nbytes, position)
        if current is None or position + len(header) + min(entry.nbytes, ALIGN) > start + chunk_bytes:
            open_chunk()
            header = local_header(name, entry.nbytes, position)
        assert current is not None
        header_offsets.append(position)
        current.constants.append((position - start, header))
        position += len(header)
        done = 0
        while done < entry.nbytes:
            take = min(entry.nbytes - done, (start + chunk_bytes - position) // ALIGN * ALIGN)
            if take <= 0:
                current = open_chunk()
                continue
            current.pieces.append(Piece(entry.index, done, take, position - start))
            position += take
            done += take
    if current is not None:
        current.nbytes = position - start
    return chunks, header_offsets, position


class _EntryTensor:
    """A parameter's data, to be pickled as entry ``index`` (inside ``_rebuild_parameter``)."""

    __slots__ = ("index", "tensor")

    def __init__(self, tensor: torch.Tensor, index: int) -> None:
        self.tensor = tensor
        self.index = index


class _StorageRef:
    """A storage named in the pickle by key: the record ``archive/data/<key>``."""

    __slots__ = ("key", "location", "numel", "storage_type")

    def __init__(self, key: int, tensor: torch.Tensor) -> None:
        self.key = key
        self.location = location_tag(tensor.untyped_storage())
        legacy = LEGACY_STORAGES.get(tensor.dtype)
        if legacy is None:  # uint16, float8, ...: as torch.save, an untyped storage and _rebuild_tensor_v3
            self.storage_type: Any = torch.UntypedStorage
            self.numel = tensor.numel() * tensor.element_size()
        else:
            self.storage_type = getattr(torch, legacy)
            self.numel = tensor.numel()


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = []
    step = 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


class _StateDict:
    """A Stateful value of the state, pickled as its state dict: an ``OrderedDict`` with the
    state dict's attributes (a module's ``_metadata``)."""

    __slots__ = ("state",)

    def __init__(self, state: Any) -> None:
        self.state = state


def _state_positions(value: Any, stateful_dicts: dict[int, Any], seen: dict[int, Any]) -> Any:
    """``value`` with each Stateful object at a value position of the state (inside dicts,
    lists and tuples from the top, as the flattener walks them) replaced by its state dict;
    containers copied (once each: one shared twice stays shared), anything else as it is, so
    that a Stateful object inside a pickled value pickles as itself, as with ``torch.save``."""
    kind = type(value)
    known = seen.get(id(value))
    if known is not None:
        return known
    if kind is dict or kind is OrderedDict:
        copy: Any = kind()
        seen[id(value)] = copy
        copy.update((k, _state_positions(v, stateful_dicts, seen)) for k, v in value.items())
        if kind is OrderedDict:
            copy.__dict__.update(value.__dict__)  # its attributes: a module's _metadata
        return copy
    if kind is list:
        items: list[Any] = []
        seen[id(value)] = items
        items.extend(_state_positions(v, stateful_dicts, seen) for v in value)
        return items
    made: Any = value
    if kind is tuple:
        made = tuple(_state_positions(v, stateful_dicts, seen) for v in value)
    elif is_stateful(value) and not isinstance(value, (dict, list, tuple)) and id(value) in stateful_dicts:
        made = _StateDict(_state_positions(stateful_dicts[id(value)], stateful_dicts, seen))
    seen[id(value)] = made
    return made


def attribute_tensors(entries: list[Entry]) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) of the tensors held in the Python attributes of the entries' tensors
    (``t.extra = torch.zeros(3)``: ``path#extra``), inside dicts, lists and tuples too.
    ``torch.save`` stores their bytes as records, as it stores every tensor's, and
    ``torch.load``'s default ``weights_only`` unpickler reads nothing else: a single file
    makes them entries."""
    found: list[tuple[str, torch.Tensor]] = []
    for entry in entries:
        if entry.kind != "tensor":
            continue
        state = torch._utils._get_obj_state(entry.tensor)  # type: ignore[no-untyped-call]
        parts = state if isinstance(state, tuple) else (state,)  # (__dict__, __slots__ values)
        pending = [
            (v, f"{entry.path}#{key_text(k)}") for part in parts if isinstance(part, dict) for k, v in part.items()
        ]
        while pending:
            value, path = pending.pop()
            if isinstance(value, torch.Tensor):
                found.append((path, value))
            elif type(value) in (dict, OrderedDict):
                pending.extend((v, key_path(path, k)) for k, v in value.items())
            elif type(value) in (list, tuple):
                pending.extend((v, key_path(path, i)) for i, v in enumerate(value))
    return found


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, entry_of: Callable[[torch.Tensor], int | None]) -> None:
        super().__init__(file, protocol=2)  # torch.save's default protocol
        self._entry_of = entry_of
        self._refs: dict[int, _StorageRef] = {}

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _StateDict):  # a Stateful value of the state: its state dict
            state = obj.state
            attributes = getattr(state, "__dict__", None) or None  # a module's _metadata
            return OrderedDict, (), attributes, None, iter(state.items())
        if isinstance(obj, _EntryTensor):
            return self._rebuild(obj.tensor, obj.index, False)  # a parameter's data, as torch.save
        if type(obj) is torch.nn.Parameter:
            index = self._entry_of(obj)
            if index is None:
                return NotImplemented
            data, hooks = _EntryTensor(obj, index), OrderedDict()  # type: ignore[var-annotated]
            state = torch._utils._get_obj_state(obj)  # type: ignore[no-untyped-call]  # Python attributes, kept as torch.save keeps them
            if state:
                return torch._utils._rebuild_parameter_with_state, (data, obj.requires_grad, hooks, state)
            return torch._utils._rebuild_parameter, (data, obj.requires_grad, hooks)
        if type(obj) is torch.Tensor:
            index = self._entry_of(obj)
            if index is None:  # not one of the save's entries (inside a pickled object)
                check_storage(obj)
                return reduce_without_legacy_storage(obj) or NotImplemented
            function, args = self._rebuild(obj, index, obj.requires_grad)
            state = torch._utils._get_obj_state(obj)  # type: ignore[no-untyped-call]
            if state:  # Python attributes: rebuilt, then set on the result, as torch.save does
                return torch._tensor._rebuild_from_type_v2, (function, torch.Tensor, args, state)
            return function, args
        if isinstance(obj, torch.Tensor):
            check_storage(obj)
        return NotImplemented  # anything else (a Stateful dict key, or inside a pickled object) as itself

    def _rebuild(self, obj: torch.Tensor, index: int, requires_grad: bool) -> Any:
        """The reduction of entry ``index`` (the tensor ``obj``): contiguous, at offset 0."""
        ref = self._refs.get(index)
        if ref is None:
            ref = self._refs[index] = _StorageRef(index, obj)
        shape = torch.Size(obj.shape)
        args: tuple[Any, ...] = (ref, 0, shape, _contiguous_stride(tuple(shape)), requires_grad, OrderedDict())
        if ref.storage_type is torch.UntypedStorage:
            return torch._utils._rebuild_tensor_v3, (*args, obj.dtype)
        return torch._utils._rebuild_tensor_v2, args

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", obj.storage_type, str(obj.key), obj.location, obj.numel)
        return None


def torch_pickle(state: Any, entry_of: Callable[[torch.Tensor], int | None], stateful_dicts: dict[int, Any]) -> bytes:
    """``data.pkl`` of the archive: ``state`` pickled as ``torch.save`` would, each tensor
    that is an entry of the save named by its entry index (``entry_of``); the state dicts
    the flattener took from Stateful objects (by ``id``) are reused, not taken again."""
    buffer = io.BytesIO()
    _Pickler(buffer, entry_of).dump(_state_positions(state, stateful_dicts, {}))
    return buffer.getvalue()
