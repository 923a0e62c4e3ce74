"""aiosnap for ``torch.distributed.checkpoint`` (DCP) users.

The one-line switch: give DCP aiosnap's storage layer, and keep the rest of the code::

    import torch.distributed.checkpoint as dcp
    import aiosnap.dcp

    dcp.save(state_dict, storage_writer=aiosnap.dcp.StorageWriter("s3://bucket/run/step-100"))
    dcp.async_save(state_dict, storage_writer=aiosnap.dcp.StorageWriter(path))
    dcp.load(state_dict, storage_reader=aiosnap.dcp.StorageReader(path))

:class:`Stager` stages ``async_save`` in reused buffers within the RAM budget
(``async_stager=aiosnap.dcp.Stager(config)``).

What the writer makes is a real DCP checkpoint (torch's ``FileSystemReader`` reads a local
one); the reader reads any DCP checkpoint (torch's writers' too). :func:`load` loads one into
live state through aiosnap's own load path (in place, partial, resharded into DTensors on
any mesh), without DCP's planner; ``aiosnap.SyncCheckpointer(folder).load(state)`` does the
same for a local DCP folder, :func:`checkpoint_storage` for any URL.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..checkpointer import SyncCheckpointer
from ..config import Config
from ..interop.dcp.api import checkpoint_storage, is_dcp_checkpoint
from ..interop.dcp.reader import StorageReader
from ..interop.dcp.stager import Stager
from ..interop.dcp.writer import StorageWriter

__all__ = ["Stager", "StorageReader", "StorageWriter", "checkpoint_storage", "is_dcp_checkpoint", "load"]


def load(
    state: dict[str, Any] | None,
    url: str | os.PathLike[str],
    *,
    config: Config | dict[str, Any] | None = None,
    paths: Sequence[str] | None = None,
    allow_pickle: bool = False,
    atomic: bool = False,
    process_group: Any | None = None,
) -> Any:
    """Load the DCP checkpoint at ``url`` (a folder, ``file://`` or ``s3://``) into
    ``state`` through aiosnap's load path; see :meth:`aiosnap.SyncCheckpointer.load` for
    ``state`` (None: return a new nested state), ``paths``, ``allow_pickle`` and
    ``atomic``. In a torch.distributed job every rank calls it, as it would make a
    checkpointer (``process_group``: the ranks that load, the default group when None)."""
    settings = config if isinstance(config, Config) else Config(**(config or {}))
    storage = checkpoint_storage(url, settings)
    with SyncCheckpointer(settings, storage=storage, process_group=process_group) as ckpt:
        return ckpt.load(state, paths=paths, allow_pickle=allow_pickle, atomic=atomic)
