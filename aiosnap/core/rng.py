"""RNGState: a Stateful view of the process's random number generators.

Put ``"rng": RNGState()`` in the state to save and restore torch's CPU (and CUDA) generators
and Python's ``random`` module, so a resumed run draws the same numbers as an
uninterrupted one. Both methods run on the caller's thread.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["RNGState"]


class RNGState:
    """Saves and restores torch (CPU, every CUDA device) and Python ``random`` state."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        if state.get("cuda") and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
