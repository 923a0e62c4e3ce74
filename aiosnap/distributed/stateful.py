"""Model and optimizer state of sharded models (FSDP2, tensor, pipeline and expert
parallelism), through torch's own ``torch.distributed.checkpoint.state_dict`` (no
hand-written name mapping).

``ShardedState(model, optimizer)`` is a Stateful value for ``save()``/``load()``: its
``state_dict()`` is ``{"model": ..., "optim": ...}`` with parameter names as keys and
DTensors (or plain tensors) as values (``get_model_state_dict`` / ``get_optimizer_state_dict``,
which also create an optimizer's state before its first step, so a load can write into it in
place). The optimizer's state is flattened by parameter name (``state.<name>.exp_avg``,
``param_groups.<name>.lr``: torch's ``flatten_optimizer_state_dict``, as torchtitan saves it),
so that the parts of a model that pipeline stages hold merge into one checkpoint key by key
and load into another split. It is restored *by key*: a load reads only the entries of the
names this model holds (a pipeline stage reads its own layers from a checkpoint of the whole
model) and hands those to ``set_model_state_dict`` / ``set_optimizer_state_dict``. Works as
well for plain and DDP models. Caller's thread.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import StateMismatchError

__all__ = ["ShardedState"]


class ShardedState:
    """A model and (optionally) its optimizer, saved and loaded by parameter name.
    ``flatten_optimizer=False`` keeps torch's nested optimizer state dict (``state`` by
    parameter, ``param_groups`` as a list): the layout of checkpoints made with aiosnap
    before pipeline layouts were supported; such a checkpoint does not reshard across
    pipeline splits."""

    restores_by_key = True
    """A load reads only the keys this object's own ``state_dict()`` has (see
    :func:`aiosnap.core.stateful.restores_by_key`)."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, flatten_optimizer: bool = True
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.flatten_optimizer = flatten_optimizer

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=self.flatten_optimizer)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        options = self._options()
        state: dict[str, Any] = {"model": get_model_state_dict(self.model, options=options)}
        if self.optimizer is not None:
            state["optim"] = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the names this model and optimizer hold from ``state`` (which may hold
        more: other pipeline stages' parameters); a name of theirs missing from it is a
        :class:`~aiosnap.errors.StateMismatchError`."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        options = self._options()
        own = self.state_dict()
        model = _own_keys(own["model"], state.get("model"), "model")
        set_model_state_dict(self.model, model, options=options)
        if self.optimizer is not None:
            optim = _own_keys(own["optim"], state.get("optim"), "optim") if self.flatten_optimizer else state["optim"]
            set_optimizer_state_dict(self.model, self.optimizer, optim, options=options)


def _own_keys(own: dict[str, Any], saved: Any, where: str) -> dict[str, Any]:
    """The items of ``saved`` whose keys ``own`` has; all of them must be there."""
    if not isinstance(saved, dict):
        raise StateMismatchError(f"{where}: the checkpoint holds no state dict here")
    missing = [k for k in own if k not in saved]
    if missing:
        raise StateMismatchError(f"{where}: key(s) {missing[:8]!r} are not in the checkpoint")
    return {k: saved[k] for k in own}
