"""``aiosnap.dcp.Stager``: staging for ``dcp.async_save`` in buffers that are kept and
reused, within aiosnap's RAM budget, spilling to the spool directory beyond it.

DCP's contract for an ``AsyncStager`` is a full copy of the state that training may not
touch (``stage`` returns it; DCP then serializes it in the background). Its default stager
allocates that copy afresh for each save, and allocation and first touch cost more than the
copy itself. This stager keeps its buffers between saves (the same key path, shape and dtype
get the same buffer; CUDA tensors are staged in pinned memory), so a save after the first
copies into memory that is already there. The buffers never hold more than ``ram_budget``
bytes: a state larger than that is staged up to the budget in RAM and the rest in files of
``spool.dir`` mapped as tensors (their pages come from the page cache, written back as the
kernel sees fit), or, without a spool directory, refused with a
:class:`~aiosnap.errors.ConfigError` naming the sizes. DTensors are staged as DTensors of the
same mesh and placements over staged local tensors.

As with DCP's own cached staging, a buffer is reused by the next ``stage``: wait for the
previous ``async_save`` to complete first (``future.result()``), as DCP requires.
``stage`` runs on the caller's thread and blocks until every byte is copied.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import tempfile
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from ...config import Config
from ...errors import ConfigError

__all__ = ["Stager"]


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and isinstance(value, torch.Tensor)


class Stager(AsyncStager):
    """Reused, budgeted staging buffers for ``dcp.async_save(..., async_stager=Stager())``."""

    _synchronize_after_execute = False  # stage() returns once the copy is complete

    def __init__(self, config: Config | dict[str, Any] | None = None) -> None:
        self.config = config if isinstance(config, Config) else Config(**(config or {}))
        self.budget = self.config.ram_budget_bytes()
        self._buffers: dict[str, torch.Tensor] = {}
        self._in_ram = 0
        self._files: list[str] = []
        self._cuda = False

    def _buffer(self, path: str, like: torch.Tensor) -> torch.Tensor:
        found = self._buffers.get(path)
        if found is not None and found.shape == like.shape and found.dtype == like.dtype:
            return found
        if found is not None:
            self._release(path)
        nbytes = like.numel() * like.element_size()
        if self._in_ram + nbytes <= self.budget:
            pin = like.device.type == "cuda" and torch.cuda.is_available()
            buffer = torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
            self._in_ram += nbytes
        else:
            buffer = self._spilled(path, like, nbytes)
        self._buffers[path] = buffer
        return buffer

    def _spilled(self, path: str, like: torch.Tensor, nbytes: int) -> torch.Tensor:
        folder = self.config.spool.dir
        if folder is None:
            raise ConfigError(
                f"aiosnap.dcp.Stager: staging {path!r} would take the staged state past ram_budget "
                f"({self.budget} bytes); raise ram_budget or set spool.dir to stage the rest on local disk"
            )
        os.makedirs(folder, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="aiosnap-staged-", suffix=".bin", dir=str(folder))
        os.close(fd)
        self._files.append(name)
        numel = math.prod(like.shape)
        flat = torch.from_file(name, shared=True, size=max(numel, 1), dtype=like.dtype)
        return flat[:numel].view(like.shape)

    def _release(self, path: str) -> None:
        old = self._buffers.pop(path)
        if not old.untyped_storage().filename:
            self._in_ram -= old.numel() * old.element_size()

    def _stage(self, value: Any, path: str) -> Any:
        if _is_dtensor(value):
            from torch.distributed.tensor import DTensor

            local = self._stage(value._local_tensor, path)
            return DTensor.from_local(
                local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
            )
        if isinstance(value, torch.Tensor):
            buffer = self._buffer(path, value)
            self._cuda |= value.device.type == "cuda"
            with torch.no_grad():
                buffer.copy_(value.detach(), non_blocking=value.device.type == "cuda")
            return buffer
        if isinstance(value, dict):
            return type(value)((k, self._stage(v, f"{path}/{k}")) for k, v in value.items())
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(self._stage(v, f"{path}/{i}") for i, v in enumerate(value))
        return copy.deepcopy(value)

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """A copy of ``state_dict`` in the stager's buffers (see the module)."""
        staged = {k: self._stage(v, str(k)) for k, v in state_dict.items()}
        if self._cuda:
            torch.cuda.synchronize()
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is complete."""

    def close(self) -> None:
        """Let the buffers go and remove the spool files."""
        self._buffers.clear()
        self._in_ram = 0
        for name in self._files:
            with contextlib.suppress(FileNotFoundError):
                os.remove(name)
        self._files.clear()
