"""asyncio helpers shared by every stage (run on whichever loop calls them)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import traceback
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, ParamSpec, TypeVar

from ..errors import first_error

__all__ = ["complete_before_cancel", "drop_frame_locals", "finish_despite_cancel", "run_all", "run_detached"]

T = TypeVar("T")
P = ParamSpec("P")


async def complete_before_cancel(operation: Coroutine[Any, Any, T]) -> T:
    """Await ``operation``; if the caller is cancelled meanwhile, let the operation run to
    its end first (no buffer still in use by a thread, no file left open, no file written
    after the caller's cleanup), then re-raise the cancellation. Every further cancellation
    while it waits is absorbed too: one that gave up waiting would leave the thread running
    past the cleanup (a save cancelled twice, by its caller and then by its own abort)."""
    task = asyncio.ensure_future(operation)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError as cancelled:
        while not task.done():
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:
                continue  # still running: the caller hears of its cancellation once it ends
        if not task.cancelled():
            task.exception()  # mark retrieved: the cancellation is what the caller reports
        raise cancelled


async def finish_despite_cancel(operation: Coroutine[Any, Any, T]) -> T:
    """Await ``operation`` to its end and return its result, however often the caller is
    cancelled meanwhile (the cancellations are absorbed: use it where an outcome must be
    reported whatever happens, such as settling a failed save)."""
    task = asyncio.ensure_future(operation)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()  # absorbed: nothing above is told to stop
            if task.done():
                return task.result()


def drop_frame_locals(error: BaseException) -> None:
    """Clear the local variables of the finished frames in ``error``'s tracebacks (its
    causes, contexts, group members and botocore's wrapped ``error`` included), keeping
    file and line numbers: a kept exception must not keep request bodies (slabs) alive.
    Frames still running are left alone. Any thread."""
    seen: set[int] = set()
    todo: list[object] = [error]
    while todo:
        item = todo.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if item.__traceback__ is not None:
            traceback.clear_frames(item.__traceback__)
        todo += [item.__cause__, item.__context__]
        if isinstance(item, BaseExceptionGroup):
            todo += item.exceptions
        wrapped = getattr(item, "kwargs", None)
        if isinstance(wrapped, dict):
            todo += wrapped.values()


async def run_all(operations: Iterable[Coroutine[Any, Any, Any]]) -> None:
    """Run ``operations`` together; the first to fail cancels the rest and is raised with its
    own type and cause (not as an exception group)."""
    try:
        async with asyncio.TaskGroup() as group:
            for operation in operations:
                group.create_task(operation)
    except BaseExceptionGroup as group_error:
        raise (leaf := first_error(group_error)) from leaf.__cause__


class _InlineExecutor(concurrent.futures.ThreadPoolExecutor):
    """Runs each submitted call at once, on the submitting thread: it never starts a thread
    (a ThreadPoolExecutor only because an event loop's default executor must be one)."""

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


def run_detached(make: Callable[[], Coroutine[Any, Any, T]], name: str) -> asyncio.Future[T]:
    """Run the coroutine ``make()`` on a daemon thread ``name`` of its own, its blocking calls
    (``to_thread``, ``run_in_executor``) inline on that thread; the returned future, of the
    running loop, gets its result. Cancelling the future abandons the thread: nothing ever
    waits for it (not this loop's closing, which waits for its default executor's threads,
    nor the interpreter's exit), so a call stuck in the kernel holds up nobody but itself.
    For short looks whose answer may come too late to matter."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def deliver(outcome: concurrent.futures.Future[T]) -> None:  # the loop thread
        if future.done():
            return
        error = outcome.exception()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(outcome.result())

    def run() -> None:  # the detached thread
        outcome: concurrent.futures.Future[T] = concurrent.futures.Future()
        own = asyncio.new_event_loop()
        own.set_default_executor(_InlineExecutor())
        try:
            outcome.set_result(own.run_until_complete(make()))
        except BaseException as exc:
            outcome.set_exception(exc)
        finally:
            own.close()
        with contextlib.suppress(RuntimeError):  # that loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(deliver, outcome)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
