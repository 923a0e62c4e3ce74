"""Structured events: every save and load is a scope of events sent to pluggable handlers.

A save emits ``start``, then one ``end`` per stage that ran (``capture``, ``spool``,
``upload``, ``commit``) with its bytes and seconds, then exactly one ``end`` or
``exception`` for the whole checkpoint -- also when the save is cancelled. A load emits
``start``, a ``fetch`` stage ``end`` and ``end``/``exception``.

Handlers are plain callables taking an :class:`Event`. Events are queued wherever they
happen (aiosnap's loop thread for saves, the caller's thread for loads) and handed to the
handlers, in order, by one dispatcher thread (``aiosnap-events``): a slow handler delays
only later events, never a save or the training loop. A handler that raises is logged
(once per handler) and otherwise ignored: events never break a checkpoint. ``close()`` of
the checkpointer delivers every queued event; ``flush_events()`` waits for them earlier.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from .units import format_bytes, format_rate

__all__ = [
    "Event",
    "ScopeEmitter",
    "EventBus",
    "EventHandler",
    "JsonlHandler",
    "LoggingHandler",
    "ProcessGroupInfo",
]

log = logging.getLogger("aiosnap")

CLOSE_TIMEOUT_S = 10.0
"""How long closing waits for event handlers to take the queued events."""

EventKind = Literal["start", "end", "exception"]
EventOp = Literal["save", "load", "resume"]
EventHandler = Callable[["Event"], None]


@dataclass(frozen=True)
class ProcessGroupInfo:
    """Who emits: this process's rank and world size in aiosnap's group, and that group's
    backend and size when torch.distributed is initialised (None otherwise)."""

    rank: int = 0
    world_size: int = 1
    backend: str | None = None
    group_size: int | None = None

    @classmethod
    def of(cls, process_group: Any | None, rank: int | None, world_size: int | None) -> ProcessGroupInfo:
        """Describe ``process_group`` (the default group when None and torch.distributed is
        initialised). Explicit ``rank``/``world_size`` win over the group's."""
        import torch.distributed as dist

        initialised = dist.is_available() and dist.is_initialized()
        if process_group is not None and not initialised:
            raise ValueError("process_group was given but torch.distributed is not initialised")
        backend: str | None = None
        group_size: int | None = None
        if initialised:
            group = process_group if process_group is not None else dist.group.WORLD
            backend = str(dist.get_backend(group))
            group_size = dist.get_world_size(group)
            if rank is None and world_size is None:  # this process's place in the group
                rank, world_size = dist.get_rank(group), group_size
            elif process_group is not None:
                rank = dist.get_rank(group) if rank is None else rank
                world_size = group_size if world_size is None else world_size
        rank = 0 if rank is None else rank
        world_size = 1 if world_size is None else world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        return cls(rank=rank, world_size=world_size, backend=backend, group_size=group_size)


@dataclass(frozen=True)
class Event:
    """One event of a save or load scope. ``stage`` is None for the checkpoint as a whole."""

    kind: EventKind
    op: EventOp
    stage: str | None
    step: int | None
    url: str
    rank: int
    world_size: int
    backend: str | None
    group_size: int | None
    save_id: str | None = None
    nbytes: int | None = None
    seconds: float | None = None
    error_type: str | None = None
    error: str | None = None
    time: float = field(default_factory=time.time)
    exception: BaseException | None = field(default=None, compare=False, repr=False)
    """The exception itself (``exception`` events only); left out of :meth:`to_dict`."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields (no exception object, nothing copied: any exception type is fine)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "exception"}

    def describe(self) -> str:
        """One human line, as the logging handler writes it."""
        what = f"{self.op} step {self.step}" + (f" {self.stage}" if self.stage else "")
        if self.kind == "exception":
            return f"aiosnap: {what} failed: {self.error_type}: {self.error}"
        if self.kind == "start":
            return f"aiosnap: {what} started ({self.url}, rank {self.rank}/{self.world_size})"
        figures = []
        if self.nbytes is not None:
            figures.append(format_bytes(self.nbytes))
        if self.seconds is not None:
            figures.append(f"{self.seconds:.3f} s")
        if self.nbytes and self.seconds:
            figures.append(format_rate(self.nbytes / self.seconds))
        return f"aiosnap: {what} done" + (f" ({', '.join(figures)})" if figures else "")


class LoggingHandler:
    """Writes each event to a standard logger (``aiosnap.events``): exceptions at WARNING,
    the rest at ``level``; the event's fields ride along as ``record.aiosnap_event``.

    ``said_on_stderr(event)``, when given, tells the events another handler writes to
    stderr already (the line per save): while logging is not set up (no handler would take
    the record, so Python's last resort would print it on stderr too), those are not
    logged, and an operator sees one line per event, not two."""

    def __init__(
        self,
        logger: str = "aiosnap.events",
        level: int = logging.INFO,
        said_on_stderr: Callable[[Event], object] | None = None,
    ) -> None:
        self.logger = logging.getLogger(logger)
        self.level = level
        self._said_on_stderr = said_on_stderr

    def __call__(self, event: Event) -> None:
        level = logging.WARNING if event.kind == "exception" else self.level
        if not self.logger.isEnabledFor(level):
            return
        if self._said_on_stderr is not None and not self.logger.hasHandlers() and self._said_on_stderr(event):
            return
        self.logger.log(level, "%s", event.describe(), extra={"aiosnap_event": event.to_dict()})


class JsonlHandler:
    """Appends each event as one JSON line to ``path`` (``~`` is the home folder, as in every
    path setting; flushed per line; thread-safe). A last line left unfinished by a crash is
    ended first, so the next event starts a line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a+b")
        self._lock = threading.Lock()
        if self.path.stat().st_size > 0:
            self._file.seek(-1, 2)
            if self._file.read(1) != b"\n":
                self._file.write(b"\n")
                self._file.flush()

    def __call__(self, event: Event) -> None:
        line = (json.dumps(event.to_dict(), allow_nan=False, default=str) + "\n").encode("utf-8")
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


class EventBus:
    """Queues events from any thread; one dispatcher thread (``aiosnap-events``, started on
    the first event) hands them to the handlers in order, so a slow or failing handler
    never holds back a save, the loop or training."""

    def __init__(self, handlers: Sequence[EventHandler], group: ProcessGroupInfo, url: str) -> None:
        self.handlers = list(handlers)
        self.group = group
        self.url = url
        self._complained: set[int] = set()
        self._queue: queue.Queue[Event | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def emit(
        self,
        kind: EventKind,
        op: EventOp,
        step: int | None,
        *,
        stage: str | None = None,
        url: str | None = None,
        save_id: str | None = None,
        nbytes: int | None = None,
        seconds: float | None = None,
        exception: BaseException | None = None,
    ) -> None:
        """Queue one event (any thread; never blocks, never raises)."""
        if not self.handlers:
            return
        event = Event(
            kind=kind,
            op=op,
            stage=stage,
            step=step,
            url=url or self.url,
            rank=self.group.rank,
            world_size=self.group.world_size,
            backend=self.group.backend,
            group_size=self.group.group_size,
            save_id=save_id,
            nbytes=nbytes,
            seconds=seconds,
            error_type=None if exception is None else type(exception).__name__,
            error=None if exception is None else str(exception),
            exception=exception,
        )
        self._ensure_dispatcher()
        self._queue.put(event)

    def _ensure_dispatcher(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._dispatch, name="aiosnap-events", daemon=True)
                self._thread.start()

    def _dispatch(self) -> None:
        """The dispatcher thread: every handler sees every event, in order."""
        while True:
            event = self._queue.get()
            try:
                if event is None:
                    self._close_handlers()
                    return
                for handler in list(self.handlers):
                    try:
                        handler(event)
                    except Exception as exc:
                        if id(handler) not in self._complained:
                            self._complained.add(id(handler))
                            log.warning(
                                "aiosnap: event handler %r failed (further failures not logged): %r", handler, exc
                            )
            finally:
                self._queue.task_done()

    def on_dispatcher_thread(self) -> bool:
        """True when called by a handler, on the dispatcher thread itself."""
        thread = self._thread
        return thread is not None and threading.current_thread() is thread

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every event emitted so far has been handled (at most ``timeout``
        seconds); returns whether they all were."""
        if self._thread is None:
            return True
        done = threading.Event()

        def wait_for_queue() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=wait_for_queue, daemon=True, name="aiosnap-flush").start()
        return done.wait(timeout)

    def scope(self, op: EventOp, step: int | None, url: str, save_id: str | None = None) -> ScopeEmitter:
        """An emitter with the fields every event of one save or load shares filled in."""
        return ScopeEmitter(self, op, step, url, save_id)

    def close(self, timeout: float | None = None) -> None:
        """Deliver what is queued, stop the dispatcher, close handlers that hold resources
        (JSON-lines files). A handler still blocked after ``timeout`` seconds is left behind
        on its daemon thread, with a warning, rather than hanging the caller."""
        timeout = CLOSE_TIMEOUT_S if timeout is None else timeout
        with self._start_lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            if thread is threading.current_thread():  # a handler closing: it cannot wait for itself
                return
            thread.join(timeout)
            if thread.is_alive():
                log.warning(
                    "aiosnap: an event handler is still blocked after %.0f s; later events are dropped", timeout
                )
        self._close_handlers()

    def _close_handlers(self) -> None:
        """Close the handlers that hold resources (JSON-lines files); idempotent."""
        for handler in self.handlers:
            if isinstance(handler, JsonlHandler):
                handler.close()


@dataclass
class ScopeEmitter:
    """Emits the events of one save or load scope (see :meth:`EventBus.scope`)."""

    bus: EventBus
    op: EventOp
    step: int | None
    url: str
    save_id: str | None = None

    def __call__(
        self,
        kind: EventKind,
        *,
        stage: str | None = None,
        nbytes: int | None = None,
        seconds: float | None = None,
        exception: BaseException | None = None,
    ) -> None:
        self.bus.emit(
            kind, self.op, self.step, stage=stage, url=self.url, save_id=self.save_id,
            nbytes=nbytes, seconds=seconds, exception=exception,
        )  # fmt: skip
