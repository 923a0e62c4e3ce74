"""A DCP checkpoint folder as an aiosnap manifest (:class:`DcpTranslator`, for
:class:`~aiosnap.interop.foreign.ForeignStorage`).

The translation, from the checked ``.metadata`` (:mod:`.metadata`) and each item's payload
(:mod:`.payloads`):

- every data file is one object, ``000000000000/<save id>/<file>``; the save id is the one
  aiosnap's writer recorded, else made from the metadata's digest (the same checkpoint gets
  the same id on every rank);
- a tensor stored as one chunk is a ``tensor`` entry, one of several chunks (a DTensor or
  sharded tensor saved by several ranks) a ``sharded`` entry whose shards are the chunks;
  payloads without a recorded checksum are cut into ranges of :data:`PIECE_BYTES` (loads
  then stage them through slabs of the RAM budget);
- a pickled value is decoded when it is plain data (ints, strings, lists, dicts...) and kept
  in the tree; anything else is a ``pickle`` entry over its pickle, loaded only with
  ``allow_pickle=True``;
- the tree nests the flattened keys back along the key paths DCP's planner recorded
  (``planner_data``: ``"model.w"`` -> ``("model", "w")``), or keeps them flat.

Coroutines on the caller's loop; no torch.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

from ...core.names import attempt_prefix
from ...errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError
from ...format.dtypes import DTYPE_ITEMSIZE
from ...format.manifest import MULTI_RANK_VERSION, PLAIN_VERSION, Manifest, Span
from ...format.tree import MAX_TREE_DEPTH
from ...storage.base import Storage
from ..foreign import STEP, Translation, VirtualObject
from ..torchpickle import contiguous_strides
from ..treecode import encode_value, nest_paths
from .checksums import is_aiosnap_save_id
from .metadata import MAX_METADATA_BYTES, METADATA_FILE, DcpMetadata, TensorItem, parse_metadata
from .payloads import NOT_PLAIN, Payload, file_sizes, item_payloads

__all__ = ["PIECE_BYTES", "DcpTranslator", "key_path", "read_metadata_bytes"]

PIECE_BYTES = 8 * 1024**2
"""Largest byte range of an unverified payload in a translated manifest."""
_RANK = re.compile(r"__(\d{1,9})_")


async def read_metadata_bytes(inner: Storage, where: str) -> bytes:
    """The ``.metadata`` file of the DCP checkpoint in ``inner``."""
    try:
        data = await inner.read(METADATA_FILE, limit=MAX_METADATA_BYTES)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise CheckpointNotFoundError(f"{where}: no DCP checkpoint (no {METADATA_FILE})") from exc
    if len(data) > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{where}: a {METADATA_FILE} of more than {MAX_METADATA_BYTES} bytes")
    return data


def key_path(planner_data: Any, fqn: str) -> tuple[Any, ...]:
    """The key path DCP's planner flattened ``fqn`` from (a tuple of str and int keys), or
    ``(fqn,)`` when the metadata does not say."""
    path = planner_data.get(fqn) if isinstance(planner_data, dict) else None
    if (
        isinstance(path, (tuple, list))
        and 0 < len(path) <= MAX_TREE_DEPTH // 2
        and all(type(k) in (str, int) for k in path)
        and ".".join(map(str, path)) == fqn
    ):
        return tuple(path)
    return (fqn,)


def _ranges(name: str, payload: Payload) -> list[list[Any]]:
    """The manifest ranges of a payload: one, with its crc32c, or pieces without."""
    if payload.crc32c is not None:
        return [[name, payload.offset, payload.nbytes, payload.crc32c]]
    found = []
    done = 0
    while done < payload.nbytes:
        take = min(PIECE_BYTES, payload.nbytes - done)
        found.append([name, payload.offset + done, take, None])
        done += take
    return found


def _range_doc(stored: list[Any]) -> dict[str, Any]:
    return dict(zip(("object", "offset", "nbytes", "crc32c"), stored, strict=True))


def _rank_of(file: str) -> int:
    match = _RANK.match(file)
    return int(match[1]) if match else 0


class _Builder:
    """The manifest document of one checkpoint."""

    def __init__(self, meta: DcpMetadata, payloads: dict[Any, Payload], save_id: str, where: str) -> None:
        self.meta = meta
        self.payloads = payloads
        self.prefix = attempt_prefix(STEP, save_id)
        self.where = where
        self.entries: list[dict[str, Any]] = []
        self.sharded = False

    def name(self, file: str) -> str:
        return f"{self.prefix}/{file}"

    def tensor(self, fqn: str, path: str, item: TensorItem) -> dict[str, Any]:
        itemsize = DTYPE_ITEMSIZE[item.dtype]
        shards: list[tuple[list[int], list[int], list[list[Any]]]] = []
        for chunk in item.chunks:
            payload = self.payloads[(fqn, chunk.offsets)]
            if not payload.contiguous:
                raise UnsupportedCheckpointError(
                    f"{self.where}: {fqn[:200]!r} is stored as a strided view (a transposed tensor saved without "
                    "a copy), which an aiosnap manifest cannot describe: load it with dcp.load (aiosnap.dcp."
                    "StorageReader reads it), or save a contiguous copy"
                )
            if math.prod(chunk.sizes):
                shards.append((list(chunk.offsets), list(chunk.sizes), _ranges(self.name(payload.file), payload)))
        nbytes = math.prod(item.size) * itemsize
        entry: dict[str, Any] = {
            "path": path, "dtype": item.dtype, "shape": list(item.size),
            "stride": list(contiguous_strides(item.size)), "device": "cpu", "nbytes": nbytes,
        }  # fmt: skip
        whole = len(item.chunks) == 1 and item.chunks[0].offsets == (0,) * len(item.size)
        if whole or not shards:
            ranges: list[list[Any]] = [r for shard in shards for r in shard[2]]
            entry.update(kind="tensor", ranges=[_range_doc(r) for r in ranges])
            return {"t": "tensor", "id": self._add(entry)}
        self.sharded = True
        entry.update(kind="sharded", ranges=[], shards=[list(shard) for shard in shards])
        return {"t": "dtensor", "id": self._add(entry)}

    def value(self, fqn: str, path: str) -> Any:
        payload = self.payloads[(fqn, None)]
        if payload.value is not NOT_PLAIN:
            return encode_value(payload.value, f"{self.where}: {fqn[:200]!r}")
        entry = {
            "path": path, "kind": "pickle", "dtype": "uint8", "shape": [payload.nbytes], "stride": [1],
            "device": "cpu", "nbytes": payload.nbytes,
            "ranges": [_range_doc(r) for r in _ranges(self.name(payload.file), payload)],
        }  # fmt: skip
        return {"t": "pickle", "id": self._add(entry)}

    def _add(self, entry: dict[str, Any]) -> int:
        self.entries.append(entry)
        return len(self.entries) - 1

    def tree(self) -> Any:
        """The nested tree, its keys in the order of the state dict DCP flattened (the
        planner's key paths keep it; the metadata lists tensors first)."""
        leaves = []
        flattened = self.meta.planner_data if isinstance(self.meta.planner_data, dict) else {}
        order = [fqn for fqn in flattened if fqn in self.meta.items]
        order += [fqn for fqn in self.meta.items if fqn not in flattened]
        for fqn in order:
            item = self.meta.items[fqn]
            path = key_path(self.meta.planner_data, fqn)
            text = "/".join(map(str, path))
            leaf = self.tensor(fqn, text, item) if isinstance(item, TensorItem) else self.value(fqn, text)
            leaves.append((path, leaf))
        return nest_paths(leaves, self.where)


class DcpTranslator:
    """DCP checkpoints for :class:`~aiosnap.interop.foreign.ForeignStorage`."""

    kind = "a DCP checkpoint"
    marker = METADATA_FILE

    def __init__(self, concurrency: int = 16) -> None:
        self.concurrency = concurrency

    async def translate(self, inner: Storage, previous: Translation | None) -> Translation:
        where = f"{inner.url}/{METADATA_FILE}"
        data = await read_metadata_bytes(inner, inner.url)
        version = hashlib.blake2b(data, digest_size=16).digest()
        if previous is not None and previous.version == version:
            return previous
        meta = parse_metadata(data, where)
        return await self.translate_metadata(inner, meta, version, where)

    async def translate_metadata(self, inner: Storage, meta: DcpMetadata, version: bytes, where: str) -> Translation:
        """The translation of the checked metadata ``meta`` of the checkpoint in ``inner``."""
        sizes = await file_sizes(inner, meta, where, concurrency=self.concurrency)
        payloads = await item_payloads(inner, meta, where, concurrency=self.concurrency, sizes=sizes)
        save_id = meta.save_id if is_aiosnap_save_id(meta.save_id) else version.hex()[:16]
        assert save_id is not None
        builder = _Builder(meta, payloads, save_id, where)
        tree = builder.tree()
        ranks = {f: _rank_of(f) for f in meta.files}
        doc = {
            "format_version": MULTI_RANK_VERSION if builder.sharded else PLAIN_VERSION,
            "step": STEP,
            "save_id": save_id,
            "created_at": 0.0,
            "world_size": max(ranks.values(), default=0) + 1,
            "objects": [{"name": builder.name(f), "rank": ranks[f], "nbytes": sizes[f]} for f in meta.files],
            "entries": builder.entries,
            "tree": tree,
            "metadata": {"format": "dcp", "dcp_version": meta.version},
        }
        manifest = Manifest.translated(doc, "dcp", where)
        objects = {builder.name(f): VirtualObject(f, 0, sizes[f]) for f in meta.files}
        integrity = [
            (f"{key[0][:200]!r} (the whole item)", Span(builder.name(loc.relative_path), loc.offset, loc.length, crc))
            for key, loc in meta.locations.items()
            if (crc := payloads[key].item_crc32c) is not None
        ]
        return Translation(manifest, objects, version, integrity)
