"""Pausing Python's cyclic garbage collector while many small objects are made.

A save of tens of thousands of tensors makes a few objects per tensor (its plan, its spec,
its manifest). Allocations that many trigger collections, and the older generations' ones
scan every object in the process, a training state's included: at 40,000 tensors they
cost as much as the work itself. Whatever is made inside :func:`gc_paused` is kept or freed
by reference counting, so nothing is lost by collecting afterwards. Any thread.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]

_lock = threading.Lock()
_pauses = 0
"""Pauses under way that hold the collector off (those begun while it was on, or joined)."""
_generation = 0
"""Bumped in a forked child: pauses begun before the fork are not the child's to end."""


@contextmanager
def gc_paused() -> Iterator[None]:
    """The collector is off inside. Pauses on several threads overlap: it comes back on
    when the last of them ends. A caller that turned it off before keeps it off (while no
    pause is under way, it is left as it is); one that turns it off from another thread
    during a pause finds it on again afterwards. A process forked during a pause starts
    with the collector on (its pausing threads do not exist there)."""
    global _pauses
    with _lock:
        joined = _pauses > 0 or gc.isenabled()
        if joined:
            if _pauses == 0:
                gc.disable()
            _pauses += 1
        generation = _generation
    try:
        yield
    finally:
        if joined:
            with _lock:
                if generation == _generation:
                    _pauses -= 1
                    if _pauses == 0:
                        gc.enable()


def _in_forked_child() -> None:
    global _lock, _pauses, _generation
    _lock = threading.Lock()  # it may have been held by a thread the child does not have
    _generation += 1
    if _pauses:
        _pauses = 0
        gc.enable()


os.register_at_fork(after_in_child=_in_forked_child)
