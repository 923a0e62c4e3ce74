"""A ``torch.save`` file as a read-only aiosnap root (:class:`TorchTranslator`, for
:class:`~aiosnap.interop.foreign.ForeignStorage`), read without ``torch.load``.

The file's zip records are found from its central directory, its ``data.pkl`` read through
the allow-list unpickler (as ``torch.load(weights_only=True)`` would allow: tensors,
parameters, plain data, dtypes, sizes, devices; anything else is a
:class:`~aiosnap.errors.CorruptCheckpointError`, nothing is run). Each tensor is an entry
whose bytes are a range of its storage's record (the same view twice -- tied weights -- is
one entry); the file is one object, ``000000000000/<save id>/<file name>``. A tensor stored
as a strided view of its storage, or two different views of one storage, cannot be
described by byte ranges: :class:`~aiosnap.errors.UnsupportedCheckpointError`. No checksums
exist for these bytes: every range is unverified. Coroutines on the caller's loop; no torch.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..core.names import attempt_prefix
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError
from ..format.dtypes import DTYPE_ITEMSIZE
from ..format.manifest import PLAIN_VERSION, Manifest
from ..storage.base import Storage
from ..storage.registry import storage_from_url
from .foreign import STEP, ForeignStorage, Translation, VirtualObject
from .torchpickle import MAX_PICKLE_BYTES, TensorRef, contiguous_strides, parse_pickle
from .torchzip import read_range, zip_records
from .treecode import encode_value

__all__ = ["PIECE_BYTES", "TorchTranslator", "is_torch_file", "torch_file_storage"]

PIECE_BYTES = 8 * 1024**2
"""Largest byte range of a tensor in the translated manifest (the bytes are unverified)."""
ZIP_MAGIC = b"PK\x03\x04"


def is_torch_file(head: bytes) -> bool:
    """Whether a file's first bytes are a zip archive's (``torch.save`` writes zips since
    torch 1.6; the legacy format is not read here)."""
    return head.startswith(ZIP_MAGIC)


@dataclass
class _Entries:
    """Entries made from the pickle's tensors, one per distinct view."""

    name: str
    records: dict[str, Any]
    where: str

    def __post_init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.by_view: dict[tuple[Any, ...], int] = {}
        self.spans: dict[str, list[tuple[int, int, str]]] = {}

    def node(self, ref: TensorRef, path: str) -> dict[str, Any]:
        key = (ref.storage.key, ref.dtype, ref.offset, ref.shape, ref.stride)
        found = self.by_view.get(key)
        if found is not None:
            return {"t": "tensor", "id": found}
        record = self.records.get(f"data/{ref.storage.key}")
        if record is None:
            raise CorruptCheckpointError(f"{self.where}: no bytes for storage {ref.storage.key!r} ({path[:200]!r})")
        if not ref.contiguous:
            raise UnsupportedCheckpointError(
                f"{self.where}: {path[:200]!r} is stored as a strided view of its storage, which byte ranges "
                "cannot describe: load the file with torch.load and save a contiguous copy"
            )
        itemsize = DTYPE_ITEMSIZE[ref.dtype]
        start, nbytes = record.offset + ref.offset * itemsize, ref.nbytes
        if ref.offset * itemsize + nbytes > record.nbytes:
            raise CorruptCheckpointError(f"{self.where}: {path[:200]!r} runs past its storage's bytes")
        for other_start, other_end, other in self.spans.get(ref.storage.key, []):
            if nbytes and start < other_end and other_start < start + nbytes:
                raise UnsupportedCheckpointError(
                    f"{self.where}: {path[:200]!r} and {other[:200]!r} are different views of one storage, which "
                    "an aiosnap manifest cannot hold: load the file with torch.load"
                )
        self.spans.setdefault(ref.storage.key, []).append((start, start + nbytes, path))
        ranges = []
        done = 0
        while done < nbytes:
            take = min(PIECE_BYTES, nbytes - done)
            ranges.append({"object": self.name, "offset": start + done, "nbytes": take, "crc32c": None})
            done += take
        self.entries.append({
            "path": path, "kind": "tensor", "dtype": ref.dtype, "shape": list(ref.shape),
            "stride": list(contiguous_strides(ref.shape)), "device": _device(ref.storage.location),
            "nbytes": nbytes, "ranges": ranges,
        })  # fmt: skip
        self.by_view[key] = len(self.entries) - 1
        return {"t": "tensor", "id": len(self.entries) - 1}


def _device(location: str) -> str:
    kind = location.split(":", 1)[0]
    return location if kind in ("cpu", "cuda", "mps", "xpu", "meta") and len(location) < 16 else "cpu"


def _paths(value: Any, prefix: str, out: dict[int, str]) -> None:
    """The key path of each tensor (by id of its TensorRef), for messages and entry paths."""
    if isinstance(value, TensorRef):
        out.setdefault(id(value), prefix or "tensor")
    elif isinstance(value, dict):
        for key, child in value.items():
            _paths(child, f"{prefix}/{key}" if prefix else str(key), out)
    elif isinstance(value, (list, tuple)):
        for index, child in enumerate(value):
            _paths(child, f"{prefix}/{index}" if prefix else str(index), out)


class TorchTranslator:
    """The ``torch.save`` file ``name`` of the inner storage (its folder)."""

    kind = "a torch.save file"

    def __init__(self, name: str) -> None:
        self.marker = name

    async def translate(self, inner: Storage, previous: Translation | None) -> Translation:
        name = self.marker
        where = f"{inner.url}/{name}"
        try:
            size = await inner.size(name)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{where}: no such file") from exc
        if not is_torch_file(await read_range(inner, name, 0, min(size, 4), where)):
            raise CorruptCheckpointError(f"{where}: not a torch.save file (not a zip archive)")
        records = await zip_records(inner, name, 0, size, where)
        pickled = records.get("data.pkl")
        if pickled is None or pickled.nbytes > MAX_PICKLE_BYTES:
            raise CorruptCheckpointError(f"{where}: not a torch.save file (no data.pkl)")
        data = await read_range(inner, name, pickled.offset, pickled.nbytes, where)
        version = hashlib.blake2b(data + size.to_bytes(8, "little"), digest_size=16).digest()
        if previous is not None and previous.version == version:
            return previous
        value, _ = parse_pickle(data, where)
        if not isinstance(value, dict):  # a file of one tensor (or a list): its value under "value"
            value = {"value": value}
        save_id = version.hex()[:16]
        virtual = f"{attempt_prefix(STEP, save_id)}/{os.path.basename(name)}"
        paths: dict[int, str] = {}
        _paths(value, "", paths)
        entries = _Entries(virtual, records, where)
        tree = encode_value(value, where, lambda ref: entries.node(ref, paths.get(id(ref), "tensor")))
        doc = {
            "format_version": PLAIN_VERSION, "step": STEP, "save_id": save_id, "created_at": 0.0,
            "world_size": 1, "objects": [{"name": virtual, "rank": 0, "nbytes": size}],
            "entries": entries.entries, "tree": tree, "metadata": {"format": "torch.save"},
        }  # fmt: skip
        manifest = Manifest.translated(doc, "torch", where)
        return Translation(manifest, {virtual: VirtualObject(name, 0, size)}, version)


def torch_file_storage(url: str, config: Config | None = None) -> ForeignStorage:
    """The ``torch.save`` file at ``url`` (a path, or ``s3://bucket/key``) as a read-only
    aiosnap root of one step."""
    parent, _, name = url.rstrip("/").rpartition("/")
    if not name:
        raise CorruptCheckpointError(f"{url}: names no file")
    if not parent:
        parent = "."
    inner = storage_from_url(parent, config)
    return ForeignStorage(inner, TorchTranslator(name), url=url)
