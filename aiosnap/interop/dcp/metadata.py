"""DCP's ``.metadata``, read as untrusted input: an allow-list unpickle, then every field
checked, into plain records (:class:`DcpMetadata`). No torch here.

``torch.distributed.checkpoint``'s ``FileSystemWriter`` pickles its ``Metadata`` object
(protocol 4): ``state_dict_metadata`` (each flattened key: a tensor's dtype, global size and
chunks, or a pickled value), ``storage_data`` (each chunk's ``MetadataIndex`` -> a
``_StorageInfo``: file, offset, length), ``planner_data`` (the flattening's key paths) and
``storage_meta``. The unpickler (:mod:`aiosnap.interop.pickles`) resolves only the classes
that graph really uses, to stand-ins, so a crafted file runs nothing; this module then
checks each record's shape and values (types, ranges, file names that stay inside the
checkpoint, chunks inside their tensor, a location for every chunk). Every problem is a
:class:`~aiosnap.errors.CorruptCheckpointError` naming the file.

:func:`to_torch` (in :mod:`aiosnap.interop.dcp.torchmeta`) builds torch's own classes from
the checked records for ``StorageReader.read_metadata``.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any

from ...core.names import check_object_name
from ...errors import CorruptCheckpointError
from ...format.dtypes import DTYPE_ITEMSIZE
from ..pickles import Record, node_budget, plain_value, unpickle_restricted

__all__ = [
    "METADATA_FILE",
    "MAX_DIMS",
    "MAX_KEY_CHARS",
    "MAX_METADATA_BYTES",
    "BytesItem",
    "Chunk",
    "DcpMetadata",
    "ItemLocation",
    "TensorItem",
    "parse_metadata",
]

METADATA_FILE = ".metadata"
MAX_METADATA_BYTES = 1024**3
"""A ``.metadata`` larger than this is refused unread (a hostile file must not exhaust memory)."""
_MAX_INT = 2**63
_MAX_DIM = 2**62
MAX_KEY_CHARS = 4096
"""Longest state dict key (and file name: 1024) a ``.metadata`` may hold."""
MAX_DIMS = 64
"""Most dimensions a tensor of a ``.metadata`` may have."""
MIN_CHUNKS, BYTES_PER_CHUNK = 1000, 8
"""A ``.metadata`` of ``n`` bytes describes at most ``MIN_CHUNKS + n // BYTES_PER_CHUNK``
chunks: a chunk DCP pickles costs 18 bytes or more, even with its offsets and sizes shared."""
MAX_CHUNK_COMPARISONS = 1_000_000
"""Pairs of chunks of one tensor compared at most (or 64 per chunk) to find an overlap."""
_MD = "torch.distributed.checkpoint.metadata"
ALLOWED = {
    f"{_MD}.Metadata", f"{_MD}.TensorStorageMetadata", f"{_MD}.TensorProperties", f"{_MD}.ChunkStorageMetadata",
    f"{_MD}.BytesStorageMetadata", f"{_MD}._MEM_FORMAT_ENCODING", f"{_MD}.MetadataIndex", f"{_MD}.StorageMeta",
    "torch.distributed.checkpoint.filesystem._StorageInfo", "torch.Size", "torch.serialization._get_layout",
    "pathlib.PosixPath", "pathlib.PurePosixPath", "pathlib.WindowsPath", "pathlib.PureWindowsPath", "pathlib.Path",
    "collections.OrderedDict", *(f"torch.{name}" for name in DTYPE_ITEMSIZE),
}  # fmt: skip
"""Every global a ``.metadata`` written by DCP's own writers (and those built on them,
such as ``s3torchconnector``'s) refers to."""
LAYOUTS = ("torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch.jagged")


@dataclass(frozen=True)
class Chunk:
    """One stored chunk of a tensor: its box in the global tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class TensorItem:
    """A tensor of the state dict: dtype, global size, stored chunks, and the properties DCP
    records (``layout`` is ``torch.strided`` for everything DCP writes)."""

    dtype: str
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    requires_grad: bool = False
    pin_memory: bool = False
    layout: str = "torch.strided"
    memory_format: int = 0


@dataclass(frozen=True)
class BytesItem:
    """A value DCP pickled with ``torch.save`` (anything that is not a tensor)."""


@dataclass(frozen=True)
class ItemLocation:
    """Where one item's bytes are: ``length`` bytes at ``offset`` of ``relative_path``
    (a name inside the checkpoint), passed through the stream ``transforms`` DCP lists."""

    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


ItemKey = tuple[str, tuple[int, ...] | None]
"""(flattened key, chunk offsets) of one stored item: the chunk offsets of a tensor's
chunk, None for a pickled value."""


@dataclass(frozen=True)
class DcpMetadata:
    """A checked ``.metadata``."""

    items: dict[str, TensorItem | BytesItem]
    locations: dict[ItemKey, ItemLocation]
    hints: dict[ItemKey, int | None]
    """The ``MetadataIndex.index`` each location was stored with (a lookup hint DCP keeps)."""
    planner_data: Any = None
    checkpoint_id: str | None = None
    save_id: str | None = None
    load_id: str | None = None
    modules: tuple[str, ...] = ()
    has_storage_meta: bool = False
    version: str | None = None

    @property
    def files(self) -> list[str]:
        """The data files the checkpoint's items are in, sorted."""
        return sorted({loc.relative_path for loc in self.locations.values()})


def _fail(where: str, message: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {message}"[:600])


def _is(value: Any, name: str) -> bool:
    return isinstance(value, Record) and value.qualname == f"{_MD}.{name}"


def _fields(value: Record, where: str, what: str, allowed: set[str]) -> dict[str, Any]:
    """The ``BUILD`` state of a dataclass record: a dict of known field names."""
    state = {} if value.state is None else value.state  # a dataclass without fields pickles no state
    if value.args not in ((), None) or type(state) is not dict or not all(type(k) is str for k in state):
        raise _fail(where, f"a {what} that is not what DCP pickles")
    unknown = set(state) - allowed
    if unknown:
        raise _fail(where, f"a {what} with unknown field(s) {sorted(unknown)[:5]!r}")
    return state


def _int(value: Any, where: str, what: str, low: int = 0, high: int = _MAX_INT) -> int:
    if type(value) is not int or not low <= value < high:
        raise _fail(where, f"{what} is not an integer in [{low}, {high})")
    return value


def _size(value: Any, where: str, what: str) -> tuple[int, ...]:
    if isinstance(value, Record) and value.qualname == "torch.Size" and len(value.args) == 1 and value.state is None:
        value = value.args[0]
    elif not isinstance(value, tuple):
        raise _fail(where, f"{what} is not a torch.Size")
    if type(value) not in (tuple, list) or len(value) > MAX_DIMS:
        raise _fail(where, f"{what} is not a torch.Size")
    return tuple(_int(v, where, what, 0, _MAX_DIM) for v in value)


def _str(value: Any, where: str, what: str, limit: int = MAX_KEY_CHARS) -> str:
    if type(value) is not str or len(value) > limit:
        raise _fail(where, f"{what} is not a string (of at most {limit} characters)")
    return value


def _dtype(value: Any, where: str) -> str:
    name = getattr(value, "qualname", "")
    if not isinstance(value, type) or not name.startswith("torch.") or name[6:] not in DTYPE_ITEMSIZE:
        raise _fail(where, "a tensor's dtype is not a torch dtype")
    return name[6:]


def _properties(value: Any, where: str) -> dict[str, Any]:
    if not _is(value, "TensorProperties") or value.args not in ((), None):
        raise _fail(where, "a tensor's properties are not TensorProperties")
    state = value.state
    if type(state) is tuple and len(state) == 5:
        dtype, layout, requires_grad, memory_format, pin = state
    elif type(state) is dict:
        known = _fields(value, where, "TensorProperties", {"dtype", "layout", "requires_grad", "pin_memory"})
        dtype, layout = known.get("dtype"), known.get("layout")
        requires_grad, memory_format, pin = known.get("requires_grad", False), None, known.get("pin_memory", False)
    else:
        raise _fail(where, "TensorProperties that are not what DCP pickles")
    found: dict[str, Any] = {"dtype": _dtype(dtype, where)}
    if layout is not None:
        if not (
            isinstance(layout, Record)
            and layout.qualname == "torch.serialization._get_layout"
            and len(layout.args) == 1
            and layout.args[0] in LAYOUTS
        ):
            raise _fail(where, "a tensor's layout is not a torch layout")
        found["layout"] = layout.args[0]
    if type(requires_grad) is not bool or type(pin) is not bool:
        raise _fail(where, "a tensor's requires_grad or pin_memory is not a bool")
    found["requires_grad"], found["pin_memory"] = requires_grad, pin
    if memory_format is not None:
        if not (
            _is(memory_format, "_MEM_FORMAT_ENCODING")
            and len(memory_format.args) == 1
            and memory_format.args[0] in (0, 1, 2)
        ):
            raise _fail(where, "a tensor's memory format is not one DCP records")
        found["memory_format"] = memory_format.args[0]
    return found


def _tensor_item(value: Record, fqn: str, where: str, budget: list[int]) -> TensorItem:
    """A tensor's metadata; ``budget[0]``: how many more chunks the file may describe (its
    chunk lists may be one list referred to by every tensor: each is counted again)."""
    here = f"{where} ({fqn[:200]!r})"
    state = _fields(value, here, "TensorStorageMetadata", {"properties", "size", "chunks"})
    if set(state) != {"properties", "size", "chunks"}:
        raise _fail(here, "TensorStorageMetadata lacks a field")
    properties = _properties(state["properties"], here)
    size = _size(state["size"], here, "a tensor's size")
    if type(state["chunks"]) is not list:
        raise _fail(here, "a tensor's chunks are not a list")
    budget[0] -= len(state["chunks"])
    if budget[0] < 0:
        raise _fail(where, "describes more chunks than its size allows (chunk lists referred to over and over)")
    chunks = []
    volume = 0
    for raw in state["chunks"]:
        if not _is(raw, "ChunkStorageMetadata"):
            raise _fail(here, "a chunk that is not ChunkStorageMetadata")
        fields = _fields(raw, here, "ChunkStorageMetadata", {"offsets", "sizes"})
        offsets, sizes = (
            _size(fields.get("offsets"), here, "a chunk's offsets"),
            _size(fields.get("sizes"), here, "a chunk's sizes"),
        )
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise _fail(here, f"a chunk of {len(offsets)} dimension(s) in a tensor of {len(size)}")
        if any(o + n > d for o, n, d in zip(offsets, sizes, size, strict=True)):
            raise _fail(here, f"a chunk at {list(offsets)} of size {list(sizes)} lies outside {list(size)}")
        volume += math.prod(sizes)
        chunks.append(Chunk(offsets, sizes))
    if volume != math.prod(size):
        raise _fail(here, f"its chunks hold {volume} elements, the tensor {math.prod(size)}")
    if len({c.offsets for c in chunks}) != len(chunks):
        raise _fail(here, "two chunks at the same offsets")
    _check_disjoint(chunks, here)
    return TensorItem(chunks=tuple(chunks), size=size, **properties)


def _check_disjoint(chunks: list[Chunk], where: str) -> None:
    """No two chunks share an element (with their volumes adding up to the tensor's, inside
    it, they then tile it: no element is stored twice or never). A sweep along the dimension
    with the most distinct chunk offsets compares each chunk only with those it meets in that
    dimension: a few per chunk for the shardings and tilings DCP writes."""
    boxes = [c for c in chunks if all(c.sizes)]
    if len(boxes) < 2:
        return
    dims = len(boxes[0].sizes)
    sweep = max(range(dims), key=lambda d: len({c.offsets[d] for c in boxes}))
    boxes.sort(key=lambda c: c.offsets[sweep])
    comparisons = max(MAX_CHUNK_COMPARISONS, 64 * len(boxes))
    open_ends: list[tuple[int, int]] = []  # (end along the sweep, index): a heap of the chunks met so far
    met: dict[int, Chunk] = {}
    for index, box in enumerate(boxes):
        start = box.offsets[sweep]
        while open_ends and open_ends[0][0] <= start:
            met.pop(heapq.heappop(open_ends)[1])
        comparisons -= len(met)
        if comparisons < 0:
            raise _fail(where, f"{len(chunks)} chunks laid out too intricately to check that they do not overlap")
        for other in met.values():
            if all(
                o1 < o2 + n2 and o2 < o1 + n1
                for o1, n1, o2, n2 in zip(box.offsets, box.sizes, other.offsets, other.sizes, strict=True)
            ):
                raise _fail(
                    where, f"the chunks at {list(other.offsets)} and {list(box.offsets)} overlap (and so leave a hole)"
                )
        met[index] = box
        heapq.heappush(open_ends, (start + box.sizes[sweep], index))


def _index(value: Any, where: str) -> tuple[ItemKey, int | None]:
    if not _is(value, "MetadataIndex"):
        raise _fail(where, "a storage_data key that is not a MetadataIndex")
    state = _fields(value, where, "MetadataIndex", {"fqn", "offset", "index"})
    fqn = _str(state.get("fqn"), where, "a MetadataIndex's fqn")
    offset = state.get("offset")
    offsets = None if offset is None else _size(offset, where, "a MetadataIndex's offset")
    hint = state.get("index")
    if hint is not None:
        _int(hint, where, "a MetadataIndex's index")
    return (fqn, offsets), hint


def _location(value: Any, where: str) -> ItemLocation:
    if not (isinstance(value, Record) and value.qualname == "torch.distributed.checkpoint.filesystem._StorageInfo"):
        raise _fail(where, "a storage_data value that is not a _StorageInfo")
    state = value.state
    if value.args not in ((), None) or type(state) is not dict:
        raise _fail(where, "a _StorageInfo that is not what DCP pickles")
    unknown = set(state) - {"relative_path", "offset", "length", "transform_descriptors"}
    if unknown:
        raise _fail(where, f"a _StorageInfo with unknown field(s) {sorted(map(str, unknown))[:5]!r}")
    path = _str(state.get("relative_path"), where, "a data file name", 1024)
    try:
        check_object_name(path)
    except ValueError:
        raise _fail(where, f"data file {path[:200]!r} is not a plain name inside the checkpoint") from None
    transforms = state.get("transform_descriptors") or ()
    if type(transforms) not in (list, tuple) or not all(type(t) is str and len(t) < 256 for t in transforms):
        raise _fail(where, "a _StorageInfo's transform descriptors are not strings")
    return ItemLocation(
        path,
        _int(state.get("offset"), where, "a _StorageInfo's offset"),
        _int(state.get("length"), where, "a _StorageInfo's length"),
        tuple(transforms),
    )


def _text_path(value: Any, where: str) -> str | None:
    """A ``checkpoint_id``: None, a string, or a pathlib path made of string parts."""
    if value is None or type(value) is str:
        return value[:4096] if value is not None else None
    if isinstance(value, Record) and value.qualname.startswith("pathlib.") and value.state is None:
        parts = [_str(p, where, "a path part") for p in value.args]
        return "/".join(parts).replace("//", "/")[:4096]
    raise _fail(where, "storage_meta's checkpoint_id is not a path")


def _storage_meta(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not _is(value, "StorageMeta"):
        raise _fail(where, "storage_meta is not a StorageMeta")
    state = _fields(value, where, "StorageMeta", {"checkpoint_id", "save_id", "load_id", "modules"})
    modules = state.get("modules") or []
    if type(modules) is not list or len(modules) > 10_000:
        raise _fail(where, "storage_meta's modules are not a list")
    for name in ("save_id", "load_id"):
        if state.get(name) is not None:
            _str(state[name], where, f"storage_meta's {name}", 256)
    return {
        "checkpoint_id": _text_path(state.get("checkpoint_id"), where),
        "save_id": state.get("save_id"),
        "load_id": state.get("load_id"),
        "modules": tuple(_str(m, where, "a module name", 256) for m in modules),
        "has_storage_meta": True,
    }


def parse_metadata(data: bytes, where: str) -> DcpMetadata:
    """The checked contents of a ``.metadata`` file read from ``where``."""
    graph = unpickle_restricted(data, ALLOWED, where, limit=MAX_METADATA_BYTES)
    if not _is(graph, "Metadata"):
        raise _fail(where, "not a DCP checkpoint's metadata")
    fields = _fields(
        graph, where, "Metadata", {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"}
    )
    described = fields.get("state_dict_metadata")
    if type(described) is not dict:
        raise _fail(where, "state_dict_metadata is not a dict")
    items: dict[str, TensorItem | BytesItem] = {}
    chunk_budget = [MIN_CHUNKS + len(data) // BYTES_PER_CHUNK]
    for fqn, value in described.items():
        _str(fqn, where, "a state dict key")
        if _is(value, "TensorStorageMetadata"):
            items[fqn] = _tensor_item(value, fqn, where, chunk_budget)
        elif _is(value, "BytesStorageMetadata"):
            _fields(value, where, "BytesStorageMetadata", set())
            items[fqn] = BytesItem()
        else:
            raise _fail(where, f"{fqn[:200]!r} is described by neither tensor nor bytes metadata")
    stored = fields.get("storage_data")
    if type(stored) is not dict:
        raise _fail(where, "storage_data is not a dict of item locations (not written by a file-system writer?)")
    locations: dict[ItemKey, ItemLocation] = {}
    hints: dict[ItemKey, int | None] = {}
    for raw_key, raw_location in stored.items():
        key, hint = _index(raw_key, where)
        if key in locations:
            raise _fail(where, f"item {key[0][:200]!r} at {key[1]} has two locations")
        locations[key] = _location(raw_location, f"{where} ({key[0][:200]!r})")
        hints[key] = hint
    _check_every_item_located(items, locations, where)
    version = fields.get("version")
    if version is not None:
        _str(version, where, "the version", 64)
    try:
        planner_data = plain_value(fields.get("planner_data"), f"{where} (planner_data)", budget=node_budget(len(data)))
    except CorruptCheckpointError:
        planner_data = None  # a planner's own data: not needed to read the checkpoint
    return DcpMetadata(
        items=items,
        locations=locations,
        hints=hints,
        planner_data=planner_data,
        version=version,
        **_storage_meta(fields.get("storage_meta"), where),
    )


def _check_every_item_located(
    items: dict[str, TensorItem | BytesItem], locations: dict[ItemKey, ItemLocation], where: str
) -> None:
    expected: set[ItemKey] = set()
    for fqn, item in items.items():
        if isinstance(item, TensorItem):
            expected |= {(fqn, c.offsets) for c in item.chunks}
        else:
            expected.add((fqn, None))
    missing = expected - set(locations)
    if missing:
        fqn, offsets = min(missing, key=str)
        raise _fail(where, f"{len(missing)} item(s) have no stored location, e.g. {fqn[:200]!r} at {offsets}")
    extra = set(locations) - expected
    if extra:
        fqn, offsets = min(extra, key=str)
        raise _fail(where, f"a location for {fqn[:200]!r} at {offsets}, which the state dict does not have")
