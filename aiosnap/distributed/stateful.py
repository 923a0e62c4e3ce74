"""Model and optimizer state of sharded models (FSDP2, tensor parallel), through torch's own
``torch.distributed.checkpoint.state_dict`` (no hand-written name mapping).

``ShardedState(model, optimizer)`` is a Stateful value for ``save()``/``load()``: its
``state_dict()`` is ``{"model": ..., "optim": ...}`` with parameter names as keys and
DTensors as values (``get_model_state_dict`` / ``get_optimizer_state_dict``, which also
create an optimizer's state before its first step, so a load can write into it in place);
``load_state_dict`` hands them to ``set_model_state_dict`` / ``set_optimizer_state_dict``.
Works as well for plain and DDP models (their values are plain tensors). Caller's thread.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ShardedState"]


class ShardedState:
    """A model and (optionally) its optimizer, saved and loaded by parameter name."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        if self.optimizer is not None:
            state["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.model, state["model"])
        if self.optimizer is not None:
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
