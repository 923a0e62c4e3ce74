"""An export into a DCP checkpoint folder, as aiosnap's DCP writer makes them.

The selection's tree is flattened as DCP flattens a state dict (nested dicts by key, lists
that hold tensors by index, ``"model.layers.0.weight"``), each tensor cut into tiles of at
most a slab (:mod:`aiosnap.interop.dcp.tiles`: chunks of its tensor in the metadata), every
other value a ``torch.save`` blob (as DCP's planner pickles it). Items are packed into data
files of at most a slab; the checksums file and ``.metadata`` (torch's own classes, pickled
as torch's writer does) are committed last, only if no checkpoint is there
(:mod:`aiosnap.interop.dcp.commit`). Torch's ``FileSystemReader`` loads the result.
"""

from __future__ import annotations

import io
import pickle
import secrets
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ...core.checksums import RangeChecksums
from ...errors import UnsupportedStateError
from ...load.apply import key_decoder
from ...load.decode import torch_dtype
from ...storage.base import Storage
from ..dcp.blobs import payload_of_value, tensor_blob
from ..dcp.checksums import SaveChecksums
from ..dcp.commit import CommitPlan, commit
from ..dcp.metadata import METADATA_FILE
from ..dcp.tiles import tile_boxes
from ..dcp.upload import data_file_name
from ..dcp.writer import DCP_VERSION, TILE_MARGIN
from ..torchpickle import contiguous_strides
from .copier import DestObject, Piece, Segment, Slice
from .selection import Selection, stub_manifest

__all__ = ["DcpSink", "flatten"]


@dataclass
class _Item:
    fqn: str
    offsets: tuple[int, ...] | None  # a tile's place in its tensor; None for a value
    segments: list[Segment]
    payload: tuple[int, int]  # (offset in the item, size)
    file: str = ""
    at: int = 0

    @property
    def nbytes(self) -> int:
        return sum(len(s) if isinstance(s, bytes) else s.nbytes for s in self.segments)


def _holds_tensors(node: Any) -> bool:
    if isinstance(node, dict):
        if node.get("t") == "tensor":
            return True
        if node.get("t") in ("dict", "odict", "stateful"):
            return True  # a mapping inside a list: DCP goes into it
        if node.get("t") == "list":
            return any(_holds_tensors(v) for v in node["items"])
    return False


def flatten(tree: Any, decode_key: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """The (key path, node) leaves of ``tree`` as DCP's ``flatten_state_dict`` makes them."""
    found: list[tuple[tuple[Any, ...], Any]] = []

    def visit(path: tuple[Any, ...], node: Any) -> None:
        tag = node.get("t") if isinstance(node, dict) else None
        if tag == "stateful":
            visit(path, node["v"])
        elif tag in ("dict", "odict"):
            for raw_key, child in node["items"]:
                visit((*path, str(decode_key(raw_key))), child)
        elif tag == "list" and any(_holds_tensors(v) for v in node["items"]):
            for index, child in enumerate(node["items"]):
                visit((*path, index), child)
        else:
            found.append((path, node))

    visit((), tree)
    return found


class DcpSink:
    """A new DCP checkpoint at the folder ``storage`` (see the module)."""

    def __init__(self, storage: Storage, allow_pickle: bool) -> None:
        self.storage = storage
        self.url = storage.url
        self.allow_pickle = allow_pickle
        self.save_id = secrets.token_hex(8)
        self._items: list[_Item] = []
        self._described: dict[str, Any] = {}
        self._mapping: dict[str, tuple[Any, ...]] = {}
        self._crcs: dict[tuple[str, int], tuple[int, int]] = {}  # (file, item offset) -> (item crc, payload crc)
        self._partial: dict[str, bytearray] = {}

    def _value(self, fqn: str, node: Any, selection: Selection) -> _Item:
        def no_tensor(index: int) -> torch.Tensor:
            raise UnsupportedStateError(f"{fqn!r}: a value holding tensors in a tuple; DCP cannot store that")

        decoder = selection.decoder(no_tensor, self.allow_pickle, self.url)
        buffer = io.BytesIO()
        torch.save(decoder(node), buffer)
        blob = buffer.getvalue()
        self._described[fqn] = BytesStorageMetadata()
        return _Item(fqn, None, [blob], payload_of_value(blob))

    def _tiles(self, fqn: str, index: int, selection: Selection, target: int) -> list[_Item]:
        entry = selection.entries[index]
        dtype = torch_dtype(entry.dtype)
        size = tuple(entry.shape)
        strides = contiguous_strides(size)
        chunks, items = [], []
        for offsets, sizes in tile_boxes(size, (0,) * len(size), size, dtype.itemsize, target):
            layout = tensor_blob(dtype, sizes)
            start = sum(o * s for o, s in zip(offsets, strides, strict=True)) * dtype.itemsize
            segments: list[Segment] = [layout.prefix, Slice(index, start, layout.payload_nbytes), layout.suffix]
            items.append(_Item(fqn, offsets, segments, (len(layout.prefix), layout.payload_nbytes)))
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        properties = TensorProperties(dtype=dtype)
        self._described[fqn] = TensorStorageMetadata(properties=properties, size=torch.Size(size), chunks=chunks)
        return items

    async def layout(self, selection: Selection, object_bytes: int) -> list[DestObject]:
        if await self.storage.exists(METADATA_FILE):
            raise FileExistsError(f"{self.url} holds a DCP checkpoint already; not replacing it (export elsewhere)")
        target = max(1, object_bytes - TILE_MARGIN)
        keys = key_decoder_for(selection)
        for path, node in flatten(selection.tree, keys):
            fqn = ".".join(map(str, path))
            if fqn in self._mapping:
                raise UnsupportedStateError(f"{fqn!r}: two key paths flatten to it; DCP cannot store both")
            self._mapping[fqn] = path
            if isinstance(node, dict) and node.get("t") == "tensor":
                self._items += self._tiles(fqn, node["id"], selection, target)
            else:
                self._items.append(self._value(fqn, node, selection))
        files: list[DestObject] = []
        current: DestObject | None = None
        for item in self._items:
            if current is None or (current.nbytes + item.nbytes > object_bytes and current.segments):
                current = DestObject(data_file_name(0, len(files), self.save_id))
                files.append(current)
            item.file, item.at = current.name, current.nbytes
            current.segments += item.segments
        return files

    async def put(self, piece: Piece) -> None:
        obj = piece.obj
        if piece.offset or len(piece.data) < obj.nbytes:  # a file larger than a slab: gathered whole
            buffer = self._partial.setdefault(obj.name, bytearray(obj.nbytes))
            buffer[piece.offset : piece.offset + len(piece.data)] = piece.data
            if piece.offset + len(piece.data) < obj.nbytes:
                return
            data = memoryview(self._partial.pop(obj.name))
            checksums = RangeChecksums(data)
            await self.storage.write(obj.name, data)
        else:
            data, checksums = piece.data, piece.checksums
            await self.storage.write_checksummed(obj.name, data, checksums)
        for item in self._items:
            if item.file == obj.name:
                start, size = item.payload
                self._crcs[(item.file, item.at)] = (
                    checksums.of(item.at, item.at + item.nbytes),
                    checksums.of(item.at + start, item.at + start + size),
                )

    async def commit(self) -> None:
        storage_data = {}
        checksums = []
        hints: dict[str, int] = {}
        for item in self._items:
            hint = hints.get(item.fqn, 0)
            hints[item.fqn] = hint + 1
            index = MetadataIndex(item.fqn, item.offsets, hint if item.offsets is not None else None)
            storage_data[index] = _StorageInfo(item.file, item.at, item.nbytes)
            item_crc, payload_crc = self._crcs[(item.file, item.at)]
            start, size = item.payload
            checksums.append((item.file, item.at, item.nbytes, item_crc, item.at + start, size, payload_crc))
        metadata = Metadata(
            state_dict_metadata=self._described, planner_data=self._mapping, storage_data=storage_data,
            storage_meta=StorageMeta(checkpoint_id=self.url, save_id=self.save_id), version=DCP_VERSION,
        )  # fmt: skip
        document = SaveChecksums(save_id=self.save_id, items=checksums).to_json()
        own = sorted({item.file for item in self._items})
        await commit(self.storage, CommitPlan(if_absent=True), pickle.dumps(metadata), document, self.save_id, own)

    async def abort(self) -> None:
        for name in sorted({item.file for item in self._items}):
            try:
                await self.storage.delete(name)
            except Exception:  # noqa: S112 - the export's own failure is what the caller hears
                continue


def key_decoder_for(selection: Selection) -> Any:
    """Decodes the selection's dict keys (plain values; never a tensor)."""
    return key_decoder(stub_manifest(selection.entries, selection.tree), allow_pickle=False)
