"""What counts as a Stateful object (modules, optimizers, schedulers, user classes)."""

from __future__ import annotations

from typing import Any

__all__ = ["is_stateful"]


def is_stateful(value: Any) -> bool:
    """True for objects with callable ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
