"""Planning a save: flatten the state, lay tensors out in chunks, name the objects.

Pure code, no I/O and no event loop; runs on the caller's thread inside ``save()``
(``state_dict()`` of Stateful objects must be taken before ``save()`` returns).

The state becomes a JSON *tree* (containers with type tags, plain values inline) whose
tensor leaves point into a table of :class:`Entry` objects. Entries are laid out in
chunks of at most ``chunk_bytes``: small tensors are batched into one chunk, a tensor
that does not fit in what is left of a chunk continues in the next one, so every chunk
but the last is full (slabs are used fully). Each chunk becomes one data object.
"""

from __future__ import annotations

import base64
import math
import pickle
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch

from ..core.gcpause import gc_paused
from ..core.names import object_prefix
from ..core.stateful import is_stateful
from ..errors import UnsupportedStateError
from ..format.classes import Row, describe
from ..format.spec import ArchiveSpec, ChunkSpec, DistSpec, EntrySpec, PieceSpec, SaveSpec, ShardSpec
from ..format.tree import MAX_TREE_DEPTH, shift_entry_ids
from .archive_plan import layout_archive, torch_pickle
from .chunks import ALIGN, Chunk, Entry, Piece, SavePlan
from .dtensor import DTensorShard, dtensor_shards, is_dtensor
from .layout_memo import Layout, LayoutMemo

__all__ = ["Agreement", "Flattened", "layout_chunks", "make_plan"]


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


class _Flattener:
    """Flattens a state into a tree and an entry table. ``rank_local``: path patterns whose
    values are flattened apart (:attr:`local`), each leaving a ``rank_local`` node behind;
    ``dtensors``: DTensors are saved as their local shards (else refused)."""

    def __init__(self, rank_local: Sequence[str] = (), *, dtensors: bool = True) -> None:
        self.entries: list[Entry] = []
        self.keys: list[tuple[Any, ...] | None] = []  # each entry's view key (None: not a plain tensor)
        self._seen: dict[tuple[Any, ...], int] = {}
        self.by_id: dict[int, int] = {}  # id(tensor) -> entry, for the tensors met
        self.stateful_dicts: dict[int, Any] = {}  # id(Stateful) -> the state dict it gave
        self._depth = 0
        self._patterns = tuple(rank_local)
        self._dtensors = dtensors
        self.shards: dict[int, DTensorShard] = {}  # entry -> its DTensor shard
        self.local: _Flattener | None = None
        self.local_values: list[Any] = []  # one tree per rank_local node, ids into local.entries
        self.local_paths: list[str] = []  # where each rank_local node is

    def encode(self, value: Any, path: str) -> Any:
        if self._patterns and path and any(fnmatchcase(path, p) for p in self._patterns):
            return self._rank_local(value, path)
        if self._depth >= MAX_TREE_DEPTH:
            raise UnsupportedStateError(f"{path}: the state is nested deeper than {MAX_TREE_DEPTH} levels")
        if type(value) is torch.Tensor:  # the common leaf first: states hold many tensors
            return {"t": "tensor", "id": self._plain(value, path)}
        self._depth += 1
        try:
            return self._encode(value, path)
        finally:
            self._depth -= 1

    def _rank_local(self, value: Any, path: str) -> Any:
        if self.local is None:
            self.local = _Flattener(dtensors=False)
            self.local._depth = self._depth
        self.local_values.append(self.local.encode(value, path))
        self.local_paths.append(path)
        return {"t": "rank_local", "slot": len(self.local_values) - 1}

    def _encode(self, value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int) and type(value) is int:
            return value
        if type(value) is float:
            return value if math.isfinite(value) else {"t": "float", "v": repr(value)}
        if isinstance(value, torch.Tensor):
            index = self._tensor(value, path)
            return {"t": "dtensor" if index in self.shards else "tensor", "id": index}
        if is_stateful(value) and not isinstance(value, (dict, list, tuple)):
            state = self.stateful_dicts[id(value)] = value.state_dict()
            return {"t": "stateful", "v": self.encode(state, path)}
        if type(value) in (dict, OrderedDict):
            node: dict[str, Any] = {"t": "dict" if type(value) is dict else "odict", "items": self._items(value, path)}
            meta = getattr(value, "_metadata", None)
            if meta is not None:
                node["meta"] = self.encode(meta, path + "#_metadata")
            return node
        if type(value) is list:
            return {"t": "list", "items": [self.encode(v, _join(path, i)) for i, v in enumerate(value)]}
        if type(value) is torch.Size:
            return {"t": "size", "items": list(value)}
        if type(value) is tuple:
            return {"t": "tuple", "items": [self.encode(v, _join(path, i)) for i, v in enumerate(value)]}
        if isinstance(value, torch.dtype):
            return {"t": "dtype", "v": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"t": "device", "v": str(value)}
        if type(value) is bytes:
            return {"t": "bytes", "v": base64.b64encode(value).decode("ascii")}
        if type(value) is complex:
            return {"t": "complex", "v": [repr(value.real), repr(value.imag)]}
        return {"t": "pickle", "id": self._pickle(value, path)}

    def _items(self, mapping: dict[Any, Any], path: str) -> list[list[Any]]:
        """A dict's ``[key, value]`` pairs, encoded; plain tensors (most of a state's
        values) without a call to :meth:`encode` each."""
        prefix = f"{path}/" if path else ""
        inline = not self._patterns and self._depth < MAX_TREE_DEPTH
        items = []
        for k, v in mapping.items():
            key = k if type(k) is str else self.encode(k, path)
            where = f"{prefix}{k}" if prefix else str(k)
            if inline and type(v) is torch.Tensor:
                items.append([key, {"t": "tensor", "id": self._plain(v, where)}])
            else:
                items.append([key, self.encode(v, where)])
        return items

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
            self.keys.append(None)
        self.by_id[id(tensor)] = first
        return first

    def _plain(self, tensor: torch.Tensor, path: str) -> int:
        """A tensor's entry (a new one, or the one of the same view met before); refuses
        tensors whose bytes cannot be saved. The per-tensor path of every save: kept short."""
        if tensor.layout is not _STRIDED or tensor.is_meta or tensor.is_quantized:
            _plain_tensor_or_refuse(tensor, path)  # raises, naming what it is
        try:
            key = _view_key(tensor)
        except (RuntimeError, NotImplementedError, TypeError):
            _plain_tensor_or_refuse(tensor, path)  # raises, naming what it is
            raise
        nbytes = tensor.nbytes
        # The same view twice (tied weights) is stored once; not a lazy conjugate or negative
        # view, whose values differ from its memory's (and from the plain view's).
        lazy = tensor.is_conj() or tensor.is_neg()
        index = self._seen.get(key) if nbytes and not lazy else None
        if index is None:
            index = len(self.entries)
            self.entries.append(Entry(index, path, "tensor", tensor, nbytes))
            self.keys.append(key)
            if not lazy:
                self._seen[key] = index
        self.by_id[id(tensor)] = index
        return index

    def entry_of(self, tensor: torch.Tensor) -> int | None:
        """The entry of a tensor met while flattening (or the same view of it), else None."""
        index = self.by_id.get(id(tensor))
        if (
            index is None
            and tensor.numel() > 0
            and tensor.layout == torch.strided
            and not (tensor.is_meta or tensor.is_conj() or tensor.is_neg())
        ):
            index = self._seen.get(_view_key(tensor))
        return index

    def _pickle(self, value: Any, path: str) -> int:
        try:
            blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise UnsupportedStateError(f"{path}: {type(value).__name__} cannot be saved: {exc}") from exc
        data = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
        index = len(self.entries)
        self.entries.append(Entry(index, path, "pickle", data, len(blob)))
        self.keys.append(None)
        return index


_STRIDED = torch.strided


def _view_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Two tensors with one key are the same bytes (one view of one storage)."""
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tensor.shape,
        tensor.stride(),
        tensor.dtype,
        tensor.device,
    )


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def layout_chunks(entries: list[Entry], chunk_bytes: int, prefix: str) -> list[Chunk]:
    """Batch small entries and split large ones into chunks of at most ``chunk_bytes``."""
    if chunk_bytes < ALIGN:
        raise ValueError(f"chunk size must be at least {ALIGN} bytes, got {chunk_bytes}")
    chunks: list[Chunk] = []

    def new_chunk() -> Chunk:
        chunk = Chunk(len(chunks), f"{prefix}/{len(chunks)}.bin")
        chunks.append(chunk)
        return chunk

    current: Chunk | None = None
    for entry in entries:
        nbytes = entry.nbytes
        if nbytes == 0:
            continue
        if current is not None:  # the common case, inline: the whole entry fits in this chunk
            start = -(-current.nbytes // ALIGN) * ALIGN
            if start + nbytes <= chunk_bytes:
                current.pieces.append(Piece(entry.index, 0, nbytes, start))
                current.nbytes = start + nbytes
                continue
        itemsize = entry.tensor.element_size()
        offset = 0
        while offset < nbytes:
            if current is None:
                current = new_chunk()
            start = _aligned(current.nbytes)
            take = min(nbytes - offset, (chunk_bytes - start) // itemsize * itemsize)
            if take <= 0:
                current = None
                continue
            current.pieces.append(Piece(entry.index, offset, take, start))
            current.nbytes = start + take
            offset += take
    return chunks


@dataclass(frozen=True)
class Flattened:
    """A state flattened on the caller's thread, before ranks agree on who writes what."""

    tree: Any
    entries: list[Entry]  # the shared table, then this rank's rank-local entries
    main_entries: int
    shards: dict[int, DTensorShard]
    local_values: list[Any]  # ids into ``entries`` (past ``main_entries``)
    local_paths: list[str]  # where each rank-local value sits in the tree
    keys: Sequence[tuple[Any, ...] | None] = ()  # each main entry's view key (None: not a plain tensor)

    def table_rows(self) -> list[Row]:
        """The main entries as this rank's part describes them
        (:func:`aiosnap.format.parts.spec_table`), for :func:`aiosnap.format.classes.describe`;
        a plain tensor's layout from its view key (reading a tensor's attributes costs more)."""
        rows: list[Row] = []
        shards, dtypes, keys = self.shards, _DTYPE_NAMES, self.keys
        for entry in self.entries[: self.main_entries]:
            key = keys[entry.index] if keys else None
            if key is None:
                shape, dtype_of = entry.tensor.shape, entry.tensor.dtype
            else:
                _, _, shape, _, dtype_of, _ = key
            dtype = dtypes.get(dtype_of)
            if dtype is None:
                dtype = dtypes[dtype_of] = str(dtype_of).removeprefix("torch.")
            shard = shards.get(entry.index)
            if shard is None:
                rows.append((entry.path, entry.kind, dtype, shape, None))
            else:
                rows.append((entry.path, "sharded", dtype, shard.global_shape, shard.mesh))
        return rows

    def local_lines(self) -> list[str]:
        """Where the rank-local values are, as the ranks compare them."""
        return [f"{path}: rank-local value {slot}" for slot, path in enumerate(self.local_paths)]


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed on for one save (:mod:`aiosnap.distributed.group`)."""

    save_id: str
    written: frozenset[int]  # the shared entries this rank writes
    coordinator: int
    commit_timeout: float
    table_of: int = 0  # the lowest rank holding the same table and tree (its part carries them)
    class_digest: str = ""  # what that table and tree are (the same on every rank of the class)
    buckets: tuple[int, ...] = ()  # digests of this rank's plain entries by bucket (who else holds them)
    checksums: tuple[tuple[int, int], ...] = ()  # (entry, crc32c) of what it holds that another class writes
    announced: tuple[str, ...] = ()  # the coordinator's: every rank's class digest, as the agreement gave it


def make_plan(
    state: dict[str, Any],
    *,
    step: int,
    chunk_bytes: int,
    rank: int = 0,
    world_size: int = 1,
    metadata: dict[str, Any] | None = None,
    single_file: bool = False,
    rank_local: Sequence[str] = (),
    agree: Callable[[Flattened], Agreement] | None = None,
    memo: LayoutMemo | None = None,
) -> SavePlan:
    """Flatten ``state`` (calling ``state_dict()`` on Stateful values) and lay out its chunks;
    with ``single_file``, as one ``torch.load``-readable file (:mod:`.archive_plan`). A
    multi-rank save (``agree``: how the ranks agree, :meth:`Flattened` in, who writes what
    out) lays out only what this rank writes. ``memo``: the layout of the caller's last
    one-rank folder save, taken as is while the table stays the same (:mod:`.layout_memo`)."""
    if not isinstance(state, dict):
        raise UnsupportedStateError(f"state must be a dict, got {type(state).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if single_file and world_size != 1:
        raise UnsupportedStateError(
            f"a single-file checkpoint is written by one process; rank {rank} of {world_size} cannot save "
            "into one (save to a folder root, or from one rank)"
        )
    if rank_local and single_file:
        raise UnsupportedStateError("rank_local values need a folder checkpoint (a single file holds one rank's state)")
    flattener = _Flattener(rank_local, dtensors=not single_file)
    with gc_paused():
        tree = flattener.encode(state, "")  # on failure the caller leaves the agreement (see checkpointer)
    if agree is None and (flattener.shards or flattener.local is not None):
        if world_size != 1:
            raise ValueError(f"rank {rank} of {world_size}: a multi-rank save needs the ranks' agreement")
        agree = _one_rank  # DTensors of a one-rank mesh, or rank-local values: the multi-rank format
    if agree is not None:
        return _distributed_plan(flattener, tree, step, chunk_bytes, rank, world_size, metadata, agree)
    with gc_paused():
        return _local_plan(flattener, tree, state, step, chunk_bytes, rank, world_size, metadata, single_file, memo)


def _local_plan(
    flattener: _Flattener,
    tree: Any,
    state: dict[str, Any],
    step: int,
    chunk_bytes: int,
    rank: int,
    world_size: int,
    metadata: dict[str, Any] | None,
    single_file: bool,
    memo: LayoutMemo | None,
) -> SavePlan:
    """Caller's thread: lay out the chunks of a one-rank save (or a single file)."""
    save_id = uuid.uuid4().hex[:16]
    prefix = object_prefix(step, save_id, rank)
    archive: ArchiveSpec | None = None
    if single_file:
        chunks, header_offsets, tail_offset = layout_archive(flattener.entries, chunk_bytes, prefix)
        blob = torch_pickle(state, flattener.entry_of, flattener.stateful_dicts)
        archive = ArchiveSpec(tuple(header_offsets), tail_offset, base64.b64encode(blob).decode("ascii"))
        entry_specs, chunk_specs = _entry_specs(flattener.entries, flattener.keys), _chunk_specs(chunks)
    else:
        chunks, entry_specs, chunk_specs = _laid_out(flattener, chunk_bytes, prefix, memo)
    spec = SaveSpec(
        step=step,
        save_id=save_id,
        rank=rank,
        world_size=world_size,
        tree=tree,
        metadata=dict(metadata or {}),
        entries=entry_specs,
        chunks=chunk_specs,
        archive=archive,
    )
    return SavePlan(spec=spec, entries=flattener.entries, chunks=chunks)


def _laid_out(
    flattener: _Flattener, chunk_bytes: int, prefix: str, memo: LayoutMemo | None
) -> tuple[list[Chunk], tuple[EntrySpec, ...], tuple[ChunkSpec, ...]]:
    """The chunks and specs of a table: the memo's when the table is the one it remembers,
    else laid out (and remembered, when every entry is a plain tensor)."""
    entries, keys = flattener.entries, flattener.keys
    paths = [entry.path for entry in entries]
    known = memo.recall(chunk_bytes, keys, paths) if memo is not None else None
    if known is not None:
        names = [f"{prefix}/{index}.bin" for index in range(len(known.chunk_sizes))]
        chunks = [
            Chunk(index, name, nbytes, pieces)
            for index, (name, nbytes, pieces) in enumerate(zip(names, known.chunk_sizes, known.pieces, strict=True))
        ]
        return chunks, known.entry_specs, known.chunk_specs(names)
    chunks = layout_chunks(entries, chunk_bytes, prefix)
    entry_specs, chunk_specs = _entry_specs(entries, keys), _chunk_specs(chunks)
    if memo is not None:
        if None in keys:
            memo.forget()  # a pickled value's bytes change from save to save
        else:
            sizes = tuple(c.nbytes for c in chunks)
            pieces = tuple(c.pieces for c in chunks)
            memo.remember(
                Layout(chunk_bytes, keys, paths, entry_specs, sizes, pieces, tuple(c.pieces for c in chunk_specs))
            )
    return chunks, entry_specs, chunk_specs


def _one_rank(flat: Flattened) -> Agreement:
    """The agreement of a job of one rank with itself: it writes everything."""
    described = describe(flat.table_rows(), flat.tree)
    return Agreement(
        uuid.uuid4().hex[:16], frozenset(range(flat.main_entries)), 0, 0.0, class_digest=described.class_digest,
        buckets=described.buckets, announced=(described.class_digest,),
    )  # fmt: skip


def _chunk_specs(chunks: list[Chunk]) -> tuple[ChunkSpec, ...]:
    return tuple(
        ChunkSpec(c.object_name, c.nbytes, tuple(PieceSpec(p.entry, p.nbytes, p.dst_offset) for p in c.pieces))
        for c in chunks
    )


def _distributed_plan(
    flattener: _Flattener,
    tree: Any,
    step: int,
    chunk_bytes: int,
    rank: int,
    world_size: int,
    metadata: dict[str, Any] | None,
    agree: Callable[[Flattened], Agreement],
) -> SavePlan:
    """Caller's thread: join the rank-local entries to the table, agree, lay out this rank's part."""
    main = len(flattener.entries)
    entries = list(flattener.entries)
    local_values: list[Any] = []
    if flattener.local is not None:
        entries += [Entry(main + e.index, e.path, e.kind, e.tensor, e.nbytes) for e in flattener.local.entries]
        local_values = [shift_entry_ids(value, main) for value in flattener.local_values]
    flat = Flattened(tree, entries, main, flattener.shards, local_values, flattener.local_paths, flattener.keys)
    agreed = agree(flat)  # with the garbage collector running: this waits for the other ranks
    with gc_paused():
        return _rank_plan(flattener, flat, agreed, step, chunk_bytes, rank, world_size, metadata)


def _rank_plan(
    flattener: _Flattener,
    flat: Flattened,
    agreed: Agreement,
    step: int,
    chunk_bytes: int,
    rank: int,
    world_size: int,
    metadata: dict[str, Any] | None,
) -> SavePlan:
    """Caller's thread: lay out what this rank writes of what the ranks agreed on."""
    entries, main, tree, local_values = flat.entries, flat.main_entries, flat.tree, flat.local_values
    writes = [e for e in entries[:main] if e.index in agreed.written] + entries[main:]
    chunks = layout_chunks(writes, chunk_bytes, object_prefix(step, agreed.save_id, rank))
    dist = DistSpec(
        coordinator=agreed.coordinator,
        commit_timeout=agreed.commit_timeout,
        main_entries=main,
        written=tuple(sorted(agreed.written)),
        shards=tuple(
            ShardSpec(index, shard.offsets, shard.global_shape, shard.mesh)
            for index, shard in sorted(flattener.shards.items())
        ),
        local_values=tuple(local_values),
        table_of=agreed.table_of,
        class_digest=agreed.class_digest,
        buckets=agreed.buckets,
        checksums=agreed.checksums,
        announced=agreed.announced,
    )
    spec = SaveSpec(
        step=step,
        save_id=agreed.save_id,
        rank=rank,
        world_size=world_size,
        tree=tree,
        metadata=dict(metadata or {}),
        entries=_entry_specs(entries, flattener.keys + (flattener.local.keys if flattener.local else [])),
        chunks=_chunk_specs(chunks),
        distributed=dist,
    )
    return SavePlan(spec=spec, entries=entries, chunks=chunks)


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_DEVICE_NAMES: dict[torch.device, str] = {}


def _entry_specs(entries: list[Entry], keys: Sequence[tuple[Any, ...] | None]) -> tuple[EntrySpec, ...]:
    """Each entry's layout as it is now, on the caller's thread (a later resize_ of a
    tensor cannot change what this save records); a plain tensor's from its view key."""
    dtypes, devices = _DTYPE_NAMES, _DEVICE_NAMES
    specs = []
    for entry, key in zip(entries, keys, strict=True):
        if key is None:
            tensor = entry.tensor
            shape, stride, dtype_of, device_of = tensor.shape, tensor.stride(), tensor.dtype, tensor.device
        else:
            _, _, shape, stride, dtype_of, device_of = key
        dtype = dtypes.get(dtype_of)
        if dtype is None:
            dtype = dtypes[dtype_of] = str(dtype_of).removeprefix("torch.")
        device = devices.get(device_of)
        if device is None:
            device = devices[device_of] = str(device_of)
        specs.append(EntrySpec(entry.path, entry.kind, dtype, tuple(shape), stride, device, entry.nbytes))
    return tuple(specs)
