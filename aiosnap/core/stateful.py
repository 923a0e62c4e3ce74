"""What counts as a Stateful object (modules, optimizers, schedulers, user classes)."""

from __future__ import annotations

from typing import Any

__all__ = ["is_stateful", "restores_by_key"]


def is_stateful(value: Any) -> bool:
    """True for objects with callable ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def restores_by_key(value: Any) -> bool:
    """True for a Stateful object that a load restores by key, like a dict of the keys its
    own ``state_dict()`` has (reading only their entries), rather than whole: one that sets
    ``restores_by_key = True`` (``aiosnap.ShardedState``: a pipeline stage's model holds part
    of a checkpoint's parameters)."""
    return is_stateful(value) and getattr(value, "restores_by_key", False) is True
