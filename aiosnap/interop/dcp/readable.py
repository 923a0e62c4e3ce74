"""What aiosnap's DCP reader accepts, checked by the writer, so that it never commits a
checkpoint its own reader refuses (the reader's limits, :mod:`.metadata`, are stricter
than torch's: keys of at most ``MAX_KEY_CHARS`` characters, tensors of at most
``MAX_DIMS`` dimensions, ...).

:func:`check_plan` looks at a rank's plan before a byte is written (each rank, in
``prepare_local_plan``); :func:`check_metadata` runs the reader's own parser on the
``.metadata`` about to be committed (the coordinator, in ``finish``), for whatever the
plan's check does not see. Both raise :class:`~aiosnap.errors.ConfigError` (the plan's
naming the key).
"""

from __future__ import annotations

from torch.distributed.checkpoint.planner import SavePlan

from ...errors import ConfigError, CorruptCheckpointError
from .metadata import MAX_DIMS, MAX_KEY_CHARS, parse_metadata

__all__ = ["check_metadata", "check_plan"]


def _refuse(where: str, what: str) -> ConfigError:
    return ConfigError(f"aiosnap.dcp.StorageWriter: {where}: {what}; aiosnap's reader would refuse the checkpoint")


def check_plan(plan: SavePlan, where: str) -> None:
    """Refuse a plan holding an item aiosnap's reader would refuse (see the module)."""
    for item in plan.items:
        fqn = item.index.fqn
        if len(fqn) > MAX_KEY_CHARS:
            raise _refuse(where, f"the key {fqn[:40]!r}... has {len(fqn)} characters (at most {MAX_KEY_CHARS})")
        data = item.tensor_data
        if data is not None and len(data.size) > MAX_DIMS:
            raise _refuse(where, f"the tensor {fqn[:200]!r} has {len(data.size)} dimensions (at most {MAX_DIMS})")


def check_metadata(document: bytes, where: str) -> None:
    """Refuse a ``.metadata`` document aiosnap's reader would refuse."""
    try:
        parse_metadata(document, where)
    except CorruptCheckpointError as exc:
        raise ConfigError(f"aiosnap.dcp.StorageWriter: not committed, aiosnap's reader would refuse it: {exc}") from exc
