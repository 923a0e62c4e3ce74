"""Where the caller's CUDA work stood when it called aiosnap: copies come after it.

``save()`` copies the caller's CUDA tensors out, and ``load(state)`` copies into them, on
aiosnap's own CUDA streams. Each first waits for an event recorded on the caller's current
stream when the call was made, so a copy sees the values the caller had queued (a save)
or lands after the work the caller had queued (a load), and nothing queued later.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CudaOrder"]


@dataclass(frozen=True)
class CudaOrder:
    """One event per CUDA device, recorded on the caller's current stream."""

    events: dict[torch.device, Any]

    @classmethod
    def record(cls, tensors: Iterable[torch.Tensor]) -> CudaOrder | None:
        """Runs on the caller's thread, inside ``save()`` or ``load()``; None when no tensor
        is on a CUDA device."""
        devices = {t.device for t in tensors if t.device.type == "cuda"}
        if not devices:
            return None
        events = {}
        for device in devices:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(device))
            events[device] = event
        return cls(events)
