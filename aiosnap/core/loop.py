"""LoopThread: the one background thread that runs aiosnap's asyncio event loop.

The async API and the sync wrapper both hand coroutines to :meth:`LoopThread.submit`
(``run_coroutine_threadsafe``) and get a ``concurrent.futures.Future`` back. Blocking on
such a future from the loop thread itself would deadlock, so :meth:`run` refuses it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Generic, Literal, TypeVar

from ..errors import ForkedProcessError, WrongThreadError

__all__ = ["LoopThread"]

T = TypeVar("T")
log = logging.getLogger("aiosnap")

CLOSE_TIMEOUT_S = 15.0
"""How long :meth:`LoopThread.stop` waits for the loop to close."""


def _new_loop(kind: Literal["auto", "uvloop", "asyncio"]) -> asyncio.AbstractEventLoop:
    if kind in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise ImportError(
                    "loop: 'uvloop' was asked for but uvloop is not installed (pip install 'aiosnap[uvloop]')"
                ) from None
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class _Handoff(Generic[T]):
    """The result of one :meth:`LoopThread.run` with an ``abandoned`` callback: either the
    caller takes it, or, once the caller has given up, ``abandoned`` does (see there)."""

    def __init__(self, abandoned: Callable[[T], None]) -> None:
        self._abandoned = abandoned
        self._lock = threading.Lock()
        self._given_up = False
        self._returned = False

    async def guard(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs on the loop thread: ``coro``, its result handed over under the lock."""
        result = await coro
        with self._lock:
            if not self._given_up:
                self._returned = True
                return result
        self._abandoned(result)
        raise asyncio.CancelledError

    def give_up(self, future: concurrent.futures.Future[T]) -> None:
        """The caller's thread, leaving early: the result goes to ``abandoned``."""
        with self._lock:
            self._given_up = True
            returned = self._returned
        if not returned:  # the coroutine sees _given_up if it still returns: cancel it
            future.cancel()
            return
        future.add_done_callback(self._done)  # returned: the future holds it, or soon will

    def _done(self, future: concurrent.futures.Future[T]) -> None:
        if not future.cancelled() and future.exception() is None:
            self._abandoned(future.result())


class LoopThread:
    """Owns a daemon thread running one event loop until :meth:`stop`."""

    def __init__(self, kind: Literal["auto", "uvloop", "asyncio"] = "auto", name: str = "aiosnap") -> None:
        self.loop = _new_loop(kind)
        self.pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = threading.Event()
        self._thread.start()
        self._started.wait()

    @property
    def kind(self) -> str:
        """``uvloop`` or ``asyncio``: the loop actually running."""
        return "uvloop" if type(self.loop).__module__.startswith("uvloop") else "asyncio"

    def _run(self) -> None:
        """Runs on the loop thread for its whole life."""
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            try:
                # Whatever is still running (a save() racing close() from another thread)
                # is cancelled, so that no caller waits forever on its future.
                leftovers = asyncio.all_tasks(self.loop)
                for task in leftovers:
                    task.cancel()
                self.loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
                self.loop.run_until_complete(self.loop.shutdown_default_executor())
            finally:
                self.loop.close()

    def in_loop_thread(self) -> bool:
        """True when called from this loop's own thread."""
        return threading.get_ident() == self._thread.ident

    def forked(self) -> bool:
        """True in a child made by ``os.fork()``: the loop's thread does not exist there."""
        return os.getpid() != self.pid

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop from any thread of the process that made it."""
        if self.forked():
            coro.close()
            raise ForkedProcessError(
                "this aiosnap checkpointer was made before os.fork(); its background thread does not exist "
                "in the child: make a new checkpointer in the child (or use the 'spawn' start method)"
            )
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(
        self,
        coro: Coroutine[Any, Any, T],
        timeout: float | None = None,
        *,
        abandoned: Callable[[T], None] | None = None,
    ) -> T:
        """Run ``coro`` on the loop and block the calling thread for its result. Left early
        (KeyboardInterrupt, timeout), the coroutine is cancelled; a result it returned anyway
        -- it was done, or finished before the cancellation reached it -- is handed to
        ``abandoned`` (a resource the caller will never see, to give back; called on the
        loop thread or this one), never lost."""
        if self.in_loop_thread():
            coro.close()
            raise WrongThreadError(
                "a blocking aiosnap call was made from aiosnap's own event-loop thread; use the async API (await) there"
            )
        if abandoned is None:
            future = self.submit(coro)
            try:
                return future.result(timeout)
            except BaseException:
                future.cancel()
                raise
        handoff = _Handoff(abandoned)
        future = self.submit(handoff.guard(coro))
        try:
            return future.result(timeout)
        except BaseException:
            handoff.give_up(future)
            raise

    def stop(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the loop and join the thread; idempotent. Not from the loop thread.

        Every aiosnap task has finished or been cancelled by then; what may remain is the
        loop's own closing, which uvloop holds up while a connection still has bytes queued
        for a peer that stopped reading (a stalled server). After ``timeout`` seconds the
        daemon thread is left to finish on its own, with a warning, rather than hanging
        ``close()``."""
        if self.forked() or not self._thread.is_alive():
            return
        if self.in_loop_thread():
            raise WrongThreadError("LoopThread.stop() called from the loop thread itself")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "aiosnap: the background event loop did not finish closing within %.0f s "
                "(a connection to a stalled peer?); leaving its daemon thread behind",
                timeout,
            )
