"""What a checkpointer adds around its engine for the operator and for the cluster.

:class:`Attachments` is made on the caller's thread as a checkpointer starts (after its
engine): the live progress display when ``events.live`` is on
(:class:`~aiosnap.core.console.LiveDisplay`), and, when ``preemption.enabled``, the
process's preemption handling (:mod:`aiosnap.core.preemption`), which, on its signal,
tells the engine on aiosnap's loop thread (:meth:`~aiosnap.service.Engine.preempted`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from ..config import Config
from ..core.console import LiveDisplay
from ..core.preemption import Preemption, watch

if TYPE_CHECKING:
    from ..core.loop import LoopThread
    from ..service import Engine

__all__ = ["Attachments"]


class Attachments:
    """The live display and the preemption subscription of one checkpointer."""

    def __init__(self, config: Config, engine: Engine, loop: LoopThread) -> None:
        self.preemption: Preemption | None = None
        self._subscription: int | None = None
        self._display: LiveDisplay | None = None
        if config.preemption.enabled:
            self.preemption = watch(config.preemption.signals, config.preemption.grace_period)

            def tell_engine() -> None:  # the preemption watcher's thread
                with contextlib.suppress(RuntimeError):  # the loop is closed: nothing in flight
                    loop.loop.call_soon_threadsafe(engine.preempted)

            self._subscription = self.preemption.subscribe(tell_engine)
        if config.events.live:
            self._display = LiveDisplay(engine.board)

    @property
    def preempted(self) -> bool:
        """True once a preemption signal has arrived (False without ``preemption.enabled``)."""
        return self.preemption is not None and self.preemption.requested

    def close(self) -> None:
        """Stop the display and hear no more preemption (the process-wide handling stays:
        a preempted process still exits as its signal would have)."""
        if self.preemption is not None and self._subscription is not None:
            self.preemption.unsubscribe(self._subscription)
            self._subscription = None
        if self._display is not None:
            self._display.close()
            self._display = None
