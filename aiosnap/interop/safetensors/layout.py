"""Hugging Face's sharded layout, planned before a byte is copied.

Pure code, no torch, no I/O (the upload process plans live exports with it):

- **Names** (:func:`hf_name`): an aiosnap path (dict keys joined by ``/``: ``model/lm_head.weight``,
  ``optim/state/0/exp_avg``) becomes a Hugging Face name by removing the ``strip`` prefix
  (``model/`` by default, when the path starts with it) and writing the remaining ``/`` as
  ``.``: ``model/lm_head.weight`` -> ``lm_head.weight``, ``model/layers/0/w`` ->
  ``layers.0.w``. Callers can pass their own mapping. Reading a folder back puts each
  tensor at ``prefix + name`` (``model/lm_head.weight``), which is where ``load({"model":
  module})`` looks for it.
- **Shards** (:func:`plan_shards`): tensors in the order given go into
  ``model-0000k-of-0000n.safetensors`` files of at most ``max_shard_size`` bytes of tensor
  data (a tensor larger than that gets a file of its own), as ``save_pretrained`` does.
  Inside a file, tensors with larger elements come first, so every tensor starts at a
  multiple of its element size (the header pads the data start to 8 bytes).
- **The index** ``model.safetensors.index.json`` (the weight map Hugging Face tools read),
  built by :func:`index_document` and parsed, as untrusted input, by :func:`parse_index`.
- **Parts** (:func:`part_ranges`): a file is written in parts of a fixed size (on S3 every
  part but the last is at least 5 MiB, which a size chosen by the storage guarantees), the
  header in the first one.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import CorruptCheckpointError
from ...storage.base import BytesLike
from .header import ITEMSIZE, build_header
from .jsonwalk import expect_end, read_small_value, read_string, walk_object

__all__ = [
    "INDEX_FILE",
    "MAX_INDEX_BYTES",
    "SINGLE_FILE",
    "ExportTensor",
    "NameRule",
    "Shard",
    "ShardTensor",
    "check_shard_file",
    "hf_name",
    "index_document",
    "map_names",
    "parse_index",
    "part_ranges",
    "plan_shards",
    "shard_file_name",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
"""The name of an unsharded model (read; exports always write shards and an index)."""
MAX_INDEX_BYTES = 32 * 1024**2
"""An index larger than this is refused unread (one of 10^5 tensors is about 10 MB)."""
_MAX_INDEX_MEMBER = 64 * 1024
"""Largest value of an index member other than the weight map (``metadata``)."""
_SHARD_FILE = re.compile(r"[A-Za-z0-9._-]{1,200}\.safetensors")

NameRule = Callable[[str], "str | None"] | Mapping[str, str]
"""A caller's own names: a function of the aiosnap path (None leaves the tensor out) or a
mapping from paths to names (paths it lacks are left out)."""


def hf_name(path: str, strip: str = "model/") -> str:
    """The Hugging Face name of the tensor at aiosnap ``path`` (see the module docstring)."""
    if strip and path.startswith(strip):
        path = path[len(strip) :]
    return path.replace("/", ".")


def map_names(paths: Sequence[str], rule: NameRule | None = None, strip: str = "model/") -> dict[str, str]:
    """path -> Hugging Face name for each of ``paths`` the rule keeps; ValueError when two
    paths would get the same name, or a name is empty."""
    names: dict[str, str] = {}
    owners: dict[str, str] = {}
    for path in paths:
        if rule is None:
            name: str | None = hf_name(path, strip)
        elif callable(rule):
            name = rule(path)
        else:
            name = rule.get(path)
        if name is None:
            continue
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"{path!r}: {name!r:.80} cannot name a safetensors tensor")
        if name in owners:
            raise ValueError(f"{owners[name]!r} and {path!r} would both be named {name!r} (pass names= to tell apart)")
        owners[name] = path
        names[path] = name
    return names


@dataclass(frozen=True)
class ExportTensor:
    """A tensor to export: its Hugging Face name, safetensors dtype code and shape, and
    whatever the caller needs to find its bytes (``source``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class ShardTensor:
    """A tensor's place in its file: bytes ``[offset, offset + nbytes)`` of the file."""

    tensor: ExportTensor
    offset: int

    @property
    def end(self) -> int:
        return self.offset + self.tensor.nbytes


@dataclass
class Shard:
    """One output file: its name, header (the file's first bytes) and tensors."""

    file: str
    header: bytes
    tensors: list[ShardTensor] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.tensor.nbytes for t in self.tensors)


def shard_file_name(index: int, count: int) -> str:
    """``model-0000k-of-0000n.safetensors`` (``index`` from 1)."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def plan_shards(
    tensors: Sequence[ExportTensor], max_shard_size: int, metadata: Mapping[str, str], *, aligned: bool = True
) -> list[Shard]:
    """Group ``tensors`` (in order) into files of at most ``max_shard_size`` data bytes and
    lay each file out; ``metadata`` (``format: pt`` first) goes into every header. With
    ``aligned`` larger elements go first in each file (every tensor at a multiple of its
    element size); without, the order given is kept (a live export writes bytes in the order
    the save captures them; the safetensors library reads unaligned tensors as well)."""
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    groups: list[list[ExportTensor]] = []
    filled = 0
    for tensor in tensors:
        if not groups or (filled + tensor.nbytes > max_shard_size and filled > 0):
            groups.append([])
            filled = 0
        groups[-1].append(tensor)
        filled += tensor.nbytes
    header_metadata = {"format": "pt", **metadata}
    shards = []
    for index, group in enumerate(groups or [[]], start=1):
        ordered = sorted(group, key=lambda t: -t.itemsize) if aligned else group  # stable: larger first
        header = build_header([(t.name, t.dtype, t.shape) for t in ordered], header_metadata)
        shard = Shard(shard_file_name(index, max(1, len(groups))), header)
        offset = len(header)
        for tensor in ordered:
            shard.tensors.append(ShardTensor(tensor, offset))
            offset += tensor.nbytes
        shards.append(shard)
    return shards


def index_document(shards: Sequence[Shard]) -> bytes:
    """``model.safetensors.index.json`` for ``shards``: total tensor bytes and the weight map."""
    weight_map = {t.tensor.name: shard.file for shard in shards for t in shard.tensors}
    total = sum(t.tensor.nbytes for shard in shards for t in shard.tensors)
    document = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(document, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def check_shard_file(name: Any, where: str) -> str:
    """``name`` if it is a plain ``*.safetensors`` file name (no folders, nothing odd)."""
    if not isinstance(name, str) or not _SHARD_FILE.fullmatch(name) or name.startswith("."):
        raise CorruptCheckpointError(f"{where}: {name!r:.120} is not a safetensors file name in this folder")
    return name


def parse_index(data: BytesLike, where: str) -> dict[str, str]:
    """The weight map (tensor name -> file name) of an index file, checked: one JSON object
    whose ``weight_map`` maps non-empty names to plain ``*.safetensors`` file names; its
    other members (``metadata``) small values. Walked one member at a time
    (:mod:`.jsonwalk`), so what it allocates is bounded by the file's size whatever its JSON."""
    if len(data) > MAX_INDEX_BYTES:
        raise CorruptCheckpointError(f"{where}: {len(data)} bytes is too large for a safetensors index")
    weight_map: dict[str, str] = {}
    files: dict[str, str] = {}  # one string per file name, however many tensors name it
    found: list[bool] = []

    def entry(name: str, pos: int) -> int:
        if not name:
            raise ValueError("weight_map names an empty tensor name")
        file, end = read_string(text, pos)
        known = files.get(file)
        if known is None:
            known = files[file] = check_shard_file(file, where)
        weight_map[name] = known
        return end

    def member(key: str, pos: int) -> int:
        if key == "weight_map":
            found.append(True)
            return walk_object(text, pos, entry)
        return read_small_value(text, pos, _MAX_INDEX_MEMBER)[1]

    try:
        text = str(data, "utf-8")
        expect_end(text, walk_object(text, 0, member))
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: not a safetensors index: {exc}") from None
    if not found or not weight_map:
        raise CorruptCheckpointError(f"{where}: no weight_map (an object of tensor names to file names)")
    return weight_map


def part_ranges(size: int, part_size: int) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` of the parts a file of ``size`` bytes is written in."""
    if part_size <= 0:
        raise ValueError(f"part size must be positive, got {part_size}")
    return [(start, min(start + part_size, size)) for start in range(0, size, part_size)] or [(0, 0)]
