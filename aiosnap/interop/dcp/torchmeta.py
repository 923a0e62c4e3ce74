"""torch's own ``Metadata`` object, built from a checked ``.metadata``
(:class:`~aiosnap.interop.dcp.metadata.DcpMetadata`), for ``StorageReader.read_metadata``.

Nothing of the file is unpickled into torch's classes: they are constructed here from plain,
validated values, as DCP's planners expect them (``storage_data`` maps each chunk's
``MetadataIndex`` to a ``_StorageInfo``, as ``FileSystemReader`` gives it).
"""

from __future__ import annotations

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

from .metadata import DcpMetadata, TensorItem

__all__ = ["to_torch"]

_FORMATS = {0: torch.contiguous_format, 1: torch.channels_last, 2: torch.preserve_format}


def _layout(name: str) -> torch.layout:
    found = getattr(torch, name.removeprefix("torch."), None)
    return found if isinstance(found, torch.layout) else torch.strided


def _tensor(item: TensorItem) -> TensorStorageMetadata:
    properties = TensorProperties(
        dtype=getattr(torch, item.dtype),
        layout=_layout(item.layout),
        requires_grad=item.requires_grad,
        memory_format=_FORMATS.get(item.memory_format, torch.contiguous_format),
        pin_memory=item.pin_memory,
    )
    chunks = [ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in item.chunks]
    return TensorStorageMetadata(properties=properties, size=torch.Size(item.size), chunks=chunks)


def to_torch(meta: DcpMetadata) -> Metadata:
    """``meta`` as torch's ``Metadata``."""
    described: dict[str, Any] = {
        fqn: _tensor(item) if isinstance(item, TensorItem) else BytesStorageMetadata()
        for fqn, item in meta.items.items()
    }
    storage_data = {
        MetadataIndex(fqn, offsets, meta.hints.get((fqn, offsets))): _StorageInfo(
            loc.relative_path, loc.offset, loc.length, list(loc.transforms) or None
        )
        for (fqn, offsets), loc in meta.locations.items()
    }
    storage_meta = None
    if meta.has_storage_meta:
        storage_meta = StorageMeta(
            checkpoint_id=meta.checkpoint_id, save_id=meta.save_id, load_id=meta.load_id, modules=list(meta.modules)
        )
    return Metadata(
        state_dict_metadata=described,
        planner_data=meta.planner_data,
        storage_data=storage_data,
        storage_meta=storage_meta,
        version=meta.version,
    )
