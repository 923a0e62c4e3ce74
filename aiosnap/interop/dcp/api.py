"""A DCP checkpoint as a read-only aiosnap root, for aiosnap's own load path.

:func:`checkpoint_storage` is a DCP checkpoint whose manifest is translated from its
``.metadata`` (:mod:`.translate`), so a checkpointer loads it like any step of its own:
``SyncCheckpointer(config, storage=checkpoint_storage(url)).load(state)`` -- in place into
the state's tensors, partially (``paths=``), resharded into the state's DTensors whatever
the mesh and world size it was saved with (:func:`aiosnap.dcp.load` in one call).
"""

from __future__ import annotations

import os
from typing import Any

from ...config import Config
from ...storage.base import Storage
from ...storage.registry import storage_from_url
from ..foreign import ForeignStorage
from .metadata import METADATA_FILE
from .translate import DcpTranslator

__all__ = ["checkpoint_storage", "is_dcp_checkpoint"]


def _settings(config: Config | dict[str, Any] | None) -> Config:
    return config if isinstance(config, Config) else Config(**(config or {}))


def checkpoint_storage(url: str | os.PathLike[str], config: Config | dict[str, Any] | None = None) -> Storage:
    """The DCP checkpoint at ``url`` (a folder, ``file://`` or ``s3://bucket/prefix``) as a
    read-only aiosnap root holding one step (step 0)."""
    settings = _settings(config)
    inner = storage_from_url(os.fspath(url), settings)
    return ForeignStorage(inner, DcpTranslator(settings.upload.concurrency))


def is_dcp_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True when the local folder ``path`` holds a DCP checkpoint (its ``.metadata``)."""
    folder = os.path.expanduser(os.fspath(path))
    return os.path.isdir(folder) and os.path.isfile(os.path.join(folder, METADATA_FILE))
