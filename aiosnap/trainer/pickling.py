"""Pickling the values a save cannot store as data, so that they unpickle again.

Plain ``pickle`` of a tensor goes through torch's legacy storage format, which has no
storage type for ``uint16``/``uint32``/``uint64``, the float8 kinds, ``complex32`` and
other newer dtypes: such a pickle is written without complaint and fails when it is loaded
(``torch.save`` keeps them, through its zip format). Here a tensor of such a dtype inside a
pickled value is reduced to its bytes (a ``uint8`` tensor, which every format keeps) and
viewed back as its dtype and shape when unpickled: by torch's own functions only, so that
``pickle.loads`` and ``torch.load`` rebuild it without aiosnap. Python attributes of the
tensor and ``requires_grad`` are kept, as ``torch.save`` keeps them. A tensor whose storage
is smaller than its view is refused, as it is in the state. Caller's thread.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from ..core.tensorio import storage_holds

__all__ = ["LEGACY_STORAGES", "check_storage", "pickle_value", "reduce_without_legacy_storage"]

LEGACY_STORAGES = torch.storage._dtype_to_storage_type_map()
"""dtype -> the legacy storage class name pickle uses (``FloatStorage``); the dtypes not in
it do not survive plain pickling."""


class _Call:
    """Pickles as ``function(*args)``: a step of a tensor's rebuild."""

    __slots__ = ("args", "function")

    def __init__(self, function: Any, *args: Any) -> None:
        self.function = function
        self.args = args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.function, self.args


_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""A dtype of each element size that torch copies (it has no copy kernel for ``uint4``, say)."""


def check_storage(tensor: torch.Tensor) -> None:
    """ValueError unless ``tensor``'s storage holds every byte of its view: pickling one
    resized smaller (``untyped_storage().resize_()``) would save memory that is not its."""
    if tensor.layout != torch.strided or tensor.is_meta:
        return
    try:
        nbytes = tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return  # no storage of its own: pickle decides what it does with it
    if not storage_holds(tensor, nbytes):
        raise ValueError(
            f"a tensor of shape {tuple(tensor.shape)} in it has a storage of {nbytes} bytes, fewer than "
            "its view reaches (was the storage resized?)"
        )


def reduce_without_legacy_storage(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """The reduction of a plain tensor whose dtype has no legacy storage (None for every
    other object): its bytes as ``uint8``, row-major (of a strided, expanded, conjugate or
    negative view: its values), viewed back as its dtype and shape."""
    if type(tensor) is not torch.Tensor or tensor.dtype in LEGACY_STORAGES or tensor.device.type == "meta":
        return None
    values = tensor.detach().resolve_conj().resolve_neg()
    carrier = _CARRIERS.get(values.element_size())
    if carrier is not None:
        values = values.view(carrier)  # the same bytes, in a dtype torch copies
    raw = values.contiguous().reshape(-1).view(torch.uint8)  # a copy only for a strided view
    rebuilt: Any = _Call(torch.Tensor.view, _Call(torch.Tensor.view, raw, tensor.dtype), tuple(tensor.shape))
    if tensor.requires_grad:
        rebuilt = _Call(torch.Tensor.requires_grad_, rebuilt)
    state = torch._utils._get_obj_state(tensor)  # type: ignore[no-untyped-call]
    if state:  # as torch does it: the rebuild, then the attributes set on its result
        return torch._tensor._rebuild_from_type_v2, (rebuilt.function, torch.Tensor, rebuilt.args, state)
    return rebuilt.function, rebuilt.args


class _ValuePickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            check_storage(obj)
            reduced = reduce_without_legacy_storage(obj)
            if reduced is not None:
                return reduced
        return NotImplemented


def pickle_value(value: Any) -> bytes:
    """``value`` pickled (highest protocol) so that ``pickle.loads`` gives it back, tensors
    of every dtype inside it included."""
    buffer = io.BytesIO()
    _ValuePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()
