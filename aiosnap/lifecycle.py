"""Checkpointers nobody closed: closed for the user, their accepted saves finished first.

A checkpointer is registered here when it starts. If it is garbage collected without
``close()``, or is still open when the interpreter exits normally, its pending saves are
waited for and its thread, slabs, spool lock and connections are released, with a
``ResourceWarning``. At exit this runs from a ``threading`` exit hook, which comes before
``concurrent.futures`` shuts its thread pools down (an ``atexit`` hook would come after, when
no file I/O can be scheduled any more). Inside a cyclic garbage collection (or on aiosnap's own
loop or event thread, which cannot wait for themselves) the closing runs on a new thread: a
collection can happen inside any allocation, on any thread, holding any lock.
"""

from __future__ import annotations

import gc
import logging
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .core.loop import LoopThread
    from .service import Engine

__all__ = ["close_when_forgotten"]

log = logging.getLogger("aiosnap")

_live: set[weakref.finalize] = set()  # type: ignore[type-arg]
_lock = threading.Lock()
_hooked = False


_at_exit = threading.local()
_closers: set[threading.Thread] = set()  # closings started after a garbage collection


def _close_all_at_exit() -> None:
    """Runs as the interpreter exits (main thread), before thread pools shut down: closings
    a collection started finish, then every checkpointer still open is closed."""
    with _lock:
        started = list(_closers)
    for closer in started:
        closer.join()
    with _lock:
        pending = list(_live)
    _at_exit.closing = True  # these calls may block: this thread holds no lock of anyone's
    try:
        for finalizer in pending:
            finalizer()
    finally:
        _at_exit.closing = False


def _hook_exit() -> None:
    global _hooked
    with _lock:
        if _hooked:
            return
        _hooked = True
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading exit hooks")
        register(_close_all_at_exit)
    except RuntimeError:  # too late (already shutting down) or not available: the plain atexit
        import atexit

        atexit.register(_close_all_at_exit)


def close_when_forgotten(
    owner: Any, loop: LoopThread, engine: Engine, url: str, *, warn: bool = True
) -> weakref.finalize:  # type: ignore[type-arg]
    """Arrange for ``owner``'s loop and engine to be closed if ``owner`` is collected or the
    interpreter exits while it is open. ``detach()`` the returned finalizer on close().
    ``warn``: say so (a ``ResourceWarning``): the user forgot ``close()``; an integration whose
    framework has no closing hook it always calls (Lightning) passes False."""
    _hook_exit()

    def forget() -> None:
        with _lock:
            _live.discard(finalizer)

    finalizer = weakref.finalize(owner, _close_abandoned, loop, engine, url, forget, warn)
    finalizer.atexit = False  # the threading exit hook above runs it, earlier
    with _lock:
        _live.add(finalizer)
    return finalizer


_collecting = threading.local()


def _note_collection(phase: str, info: dict[str, Any]) -> None:
    """``gc.callbacks`` hook: whether this thread is inside a cyclic garbage collection."""
    _collecting.active = phase == "start"


gc.callbacks.append(_note_collection)


def _close_abandoned(loop: LoopThread, engine: Engine, url: str, forget: Any, warn: bool) -> None:
    """The finalizer: close on this thread (the last reference was dropped here, or the
    interpreter exits), or on a new thread when waiting here could deadlock: inside a
    cyclic garbage collection, which runs within whatever allocation triggered it, possibly
    while this thread holds a lock the closing needs (a thread pool's, taken by another
    checkpointer's loop thread in ``submit``: waiting there deadlocked); or on a thread the
    closing must wait for (the loop thread, the event dispatcher)."""
    forget()
    if loop.forked():
        return  # a forked child: nothing of it runs here
    in_collection = getattr(_collecting, "active", False) and not getattr(_at_exit, "closing", False)
    if not (in_collection or loop.in_loop_thread() or engine.events.on_dispatcher_thread()):
        _close_now(loop, engine, url, warn)
        return

    def close() -> None:
        try:
            _close_now(loop, engine, url, warn)
        finally:
            with _lock:
                _closers.discard(threading.current_thread())

    closer = threading.Thread(target=close, name="aiosnap-close")
    with _lock:
        _closers.add(closer)
    closer.start()


def _close_now(loop: LoopThread, engine: Engine, url: str, warn: bool) -> None:
    pending = len(engine._jobs)
    if pending:
        log.log(
            logging.WARNING if warn else logging.INFO,
            "aiosnap: %s was not closed; waiting for %d save(s) to finish", url, pending,
        )  # fmt: skip
    try:
        loop.run(engine.drain(None))
    except BaseException as exc:
        log.warning("aiosnap: %s: saves of an unclosed checkpointer did not finish: %r", url, exc)
    finally:
        try:
            loop.run(engine.shutdown())
        finally:
            loop.stop()
            engine.events.close()
    for failure in engine.failures.take_all():
        log.error("aiosnap: %s: a save of an unclosed checkpointer failed: %r", url, failure)
    if warn:
        warnings.warn(
            f"aiosnap: a checkpointer for {url} was not closed (closed for you)", ResourceWarning, stacklevel=1
        )
