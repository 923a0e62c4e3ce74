"""``aiosnap.dcp.Stager``: staging for ``dcp.async_save`` in buffers that are kept and
reused, within aiosnap's RAM budget, spilling to the spool directory beyond it.

DCP's contract for an ``AsyncStager`` is a full copy of the state that training may not
touch (``stage`` returns it; DCP then serializes it in the background). Its default stager
allocates that copy afresh for each save, and allocation and first touch cost more than the
copy itself. This stager keeps its buffers between saves (the same place in the state --
the same keys, not only the same key text -- with the same shape and dtype gets the same
buffer; CUDA tensors are staged in pinned memory), so a save after the first copies into
memory that is already there. The buffers never hold more than ``ram_budget`` bytes: a
state larger than that is staged up to the budget in RAM and the rest in files of
``spool.dir`` mapped as tensors (their pages come from the page cache, written back as the
kernel sees fit), at most ``spool.budget`` bytes of them; past either budget (or past the RAM
budget without a spool directory) ``stage`` raises a :class:`~aiosnap.errors.ConfigError`
naming the sizes. A spill file is unlinked as soon as it is mapped: its space goes back
when its buffer is let go (replaced by one of another shape, ``close()``, the stager
collected) or the process ends, however it ends. DTensors are staged as DTensors of the
same mesh and placements over staged local tensors.

As with DCP's own cached staging, a buffer is reused by the next ``stage``: wait for the
previous ``async_save`` to complete first (``future.result()``), as DCP requires.
``stage`` runs on the caller's thread (one call at a time) and blocks until every byte is
copied.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from ...config import Config
from ...errors import ConfigError
from ...handoff.spooldir import spool_budget_bytes

__all__ = ["Stager"]


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and isinstance(value, torch.Tensor)


Place = tuple[Any, ...]
"""Where a tensor is in the state: the keys (and list indices) leading to it, as they are
(``("a/b",)`` and ``("a", "b")`` are two places, ``(1,)`` and ``("1",)`` too)."""


class Stager(AsyncStager):
    """Reused, budgeted staging buffers for ``dcp.async_save(..., async_stager=Stager())``."""

    _synchronize_after_execute = False  # stage() returns once the copy is complete

    def __init__(self, config: Config | dict[str, Any] | None = None) -> None:
        self.config = config if isinstance(config, Config) else Config(**(config or {}))
        self.budget = self.config.ram_budget_bytes()
        self._buffers: dict[Place, torch.Tensor] = {}
        self._in_ram = 0
        self._spilled = 0
        self._spool_budget: int | None = None
        self._lock = threading.Lock()
        self._cuda = False

    def _buffer(self, place: Place, like: torch.Tensor) -> torch.Tensor:
        found = self._buffers.get(place)
        if found is not None and found.shape == like.shape and found.dtype == like.dtype:
            return found
        if found is not None:
            self._release(place)
        nbytes = like.numel() * like.element_size()
        if self._in_ram + nbytes <= self.budget:
            pin = like.device.type == "cuda" and torch.cuda.is_available()
            buffer = torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
            self._in_ram += nbytes
        else:
            buffer = self._spill(place, like, nbytes)
            self._spilled += nbytes
        self._buffers[place] = buffer
        return buffer

    def _spill(self, place: Place, like: torch.Tensor, nbytes: int) -> torch.Tensor:
        """A buffer in a file of the spool directory, unlinked once mapped."""
        folder = self.config.spool.dir
        name = "/".join(map(str, place))
        if folder is None:
            raise ConfigError(
                f"aiosnap.dcp.Stager: staging {name!r} would take the staged state past ram_budget "
                f"({self.budget} bytes); raise ram_budget or set spool.dir to stage the rest on local disk"
            )
        root = Path(folder).expanduser()
        root.mkdir(parents=True, exist_ok=True)
        if self._spool_budget is None:
            self._spool_budget = spool_budget_bytes(self.config.spool, root)
        if self._spilled + nbytes > self._spool_budget:
            raise ConfigError(
                f"aiosnap.dcp.Stager: staging {name!r} ({nbytes} bytes) would take what is staged in spool.dir "
                f"past spool.budget ({self._spilled} of {self._spool_budget} bytes used, with ram_budget "
                f"{self.budget} full); raise ram_budget or spool.budget"
            )
        fd, path = tempfile.mkstemp(prefix="aiosnap-staged-", suffix=".bin", dir=root)
        os.close(fd)
        try:
            numel = math.prod(like.shape)
            flat = torch.from_file(path, shared=True, size=max(numel, 1), dtype=like.dtype)
        finally:
            os.remove(path)  # the mapping keeps the bytes; the name would outlive a killed process
        return flat[:numel].view(like.shape)

    def _release(self, place: Place) -> None:
        old = self._buffers.pop(place)
        nbytes = old.numel() * old.element_size()
        if old.untyped_storage().filename:
            self._spilled -= nbytes
        else:
            self._in_ram -= nbytes

    def _stage(self, value: Any, place: Place) -> Any:
        if _is_dtensor(value):
            from torch.distributed.tensor import DTensor

            local = self._stage(value._local_tensor, place)
            return DTensor.from_local(
                local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
            )
        if isinstance(value, torch.Tensor):
            buffer = self._buffer(place, value)
            self._cuda |= value.device.type == "cuda"
            with torch.no_grad():
                buffer.copy_(value.detach(), non_blocking=value.device.type == "cuda")
            return buffer
        if isinstance(value, dict):
            return type(value)((k, self._stage(v, (*place, k))) for k, v in value.items())
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(self._stage(v, (*place, i)) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """A copy of ``state_dict`` in the stager's buffers (see the module)."""
        with self._lock:
            staged = {k: self._stage(v, (k,)) for k, v in state_dict.items()}
            if self._cuda:
                torch.cuda.synchronize()
            return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is complete."""

    def close(self) -> None:
        """Let the buffers go (a spill file's space comes back once nothing else holds its
        buffer either)."""
        with self._lock:
            self._buffers.clear()
            self._in_ram = self._spilled = 0
