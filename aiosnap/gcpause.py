"""Pausing Python's cyclic garbage collector while many small objects are made.

A save of tens of thousands of tensors makes a few objects per tensor (its plan, its spec,
its manifest). Allocations that many trigger collections, and the older generations' ones
scan every object in the process, a training state's included: at 40,000 tensors they
cost as much as the work itself. Whatever is made inside :func:`gc_paused` is kept or freed
by reference counting, so nothing is lost by collecting afterwards. Any thread.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]


@contextmanager
def gc_paused() -> Iterator[None]:
    """The collector is off inside, and switched back on only if it was on: a caller that
    turned it off keeps it off (one that turns it off from another thread meanwhile finds
    it on again afterwards). Threads that pause it together leave it on when the first
    leaves: a collection may then run inside the others' work, which costs time only."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
