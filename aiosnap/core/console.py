"""What an operator sees of saves without setting up logging: a line per save, a live display.

:class:`SaveLineHandler` is an event handler (``events.stderr``, on by default) that writes
one line to stderr when a save commits (rank 0 only: every rank of a multi-rank save
reports the same commit) or fails (every rank: each failure is its own), and when a save
left in the spool by an earlier process is finished::

    aiosnap: step 200 committed: 479.7 MiB in 1.2 s (399.7 MiB/s) to /data/ckpt

:class:`LiveDisplay` (``events.live``, off by default) draws a Rich progress bar per save on
stderr while saves upload, once one has run for :data:`LIVE_AFTER_S`, and only when stderr is
a terminal. Its thread (``aiosnap-live``) reads the saves' progress; it never touches a save.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, TextIO

from .events import Event
from .progress import MiB, ProgressBoard, SaveProgress
from .units import format_bytes, format_rate

__all__ = ["LIVE_AFTER_S", "STAYS_COMMITTED", "LiveDisplay", "SaveLineHandler", "save_line"]

LIVE_AFTER_S = 2.0
"""A save shows in the live display once it has run this long (short saves never do)."""

REFRESH_S = 0.25

_ERROR_CHARS = 300


STAYS_COMMITTED = "stays committed and does not load"
"""Words of the one save failure after which the latest committed step is not what it was
(a commit that could not be taken back): its console line does not say it is unchanged."""


def _figures(nbytes: int | None, seconds: float | None) -> str:
    if nbytes is None or seconds is None:
        return ""
    rate = f" ({format_rate(nbytes / seconds)})" if seconds > 0 else ""
    timed = f"{seconds:.1f} s" if seconds >= 0.1 else f"{seconds * 1000:.0f} ms"
    return f": {format_bytes(nbytes)} in {timed}{rate}"


def save_line(event: Event) -> str | None:
    """The line an operator sees for ``event``, or None for the events that have none (the
    stages of a save, starts, loads, and the commits of ranks other than 0)."""
    if event.stage is not None or event.kind == "start":
        return None
    rank = f" on rank {event.rank}" if event.world_size > 1 else ""
    if event.op == "save" and event.kind == "end":
        if event.rank != 0:
            return None
        return f"aiosnap: step {event.step} committed{_figures(event.nbytes, event.seconds)} to {event.url}"
    if event.op == "save":
        if event.error_type == "CancelledError":
            return f"aiosnap: step {event.step} cancelled{rank}; nothing of it was committed ({event.url})"
        error = next(iter((event.error or "").strip().splitlines()), "")
        if len(error) > _ERROR_CHARS:
            error = error[:_ERROR_CHARS] + "..."
        if STAYS_COMMITTED in (event.error or ""):
            return f"aiosnap: step {event.step} failed{rank}: {event.error_type}: {error} ({event.url})"
        return (
            f"aiosnap: step {event.step} failed{rank}: {event.error_type}: {error} "
            f"({event.url}; the latest committed step is unchanged)"
        )
    if event.op == "resume" and event.kind == "end":
        figures = _figures(event.nbytes, event.seconds)
        return f"aiosnap: step {event.step} finished from the spool{figures} to {event.url}"
    return None


class SaveLineHandler:
    """Event handler: :func:`save_line` of each event, written to ``stream`` (stderr at the
    time of the event by default) and flushed. Runs on the event dispatcher thread."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream

    def __call__(self, event: Event) -> None:
        line = save_line(event)
        if line is None:
            return
        stream = self._stream if self._stream is not None else sys.stderr
        stream.write(line + "\n")
        stream.flush()


class LiveDisplay:
    """A transient Rich progress display of the saves on ``board`` that have run for
    :data:`LIVE_AFTER_S`, on ``console`` (stderr by default; nothing at all unless it is a
    terminal). Started by the checkpointer; :meth:`close` ends it."""

    def __init__(self, board: ProgressBoard, console: Any | None = None) -> None:
        from rich.console import Console

        self._board = board
        self._console = console if console is not None else Console(stderr=True)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._console.is_terminal:
            self._thread = threading.Thread(target=self._run, name="aiosnap-live", daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def _run(self) -> None:
        """The display thread: one Rich Progress while saves are shown, none in between (the
        terminal is the trainer's the rest of the time)."""
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

        bar: Progress | None = None
        tasks: dict[int, Any] = {}
        while not self._stop.wait(REFRESH_S):
            shown = [p for p in self._board.snapshots() if p.elapsed_s >= LIVE_AFTER_S and not p.done]
            if not shown:
                if bar is not None:
                    bar.stop()
                    bar, tasks = None, {}
                continue
            if bar is None:
                bar = Progress(
                    "[progress.description]{task.description}", BarColumn(), DownloadColumn(binary_units=True),
                    "{task.fields[rate]}", TimeRemainingColumn(), console=self._console, transient=True,
                )  # fmt: skip
                bar.start()
            for key in [k for k in tasks if k not in {p.step for p in shown}]:
                bar.remove_task(tasks.pop(key))
            for progress in shown:
                self._show(bar, tasks, progress)
        if bar is not None:
            bar.stop()

    @staticmethod
    def _show(bar: Any, tasks: dict[int, Any], progress: SaveProgress) -> None:
        description = f"aiosnap step {progress.step} {progress.stage}"
        rate = f"{progress.upload_rate / MiB:.1f} MiB/s" if progress.upload_rate else ""
        if progress.step not in tasks:
            tasks[progress.step] = bar.add_task(description, total=progress.total_bytes, rate=rate)
        bar.update(
            tasks[progress.step], description=description, completed=progress.uploaded_bytes,
            total=progress.total_bytes, rate=rate,
        )  # fmt: skip

    def close(self) -> None:
        """Take the display down (at most one refresh later); idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5 * REFRESH_S + 1)
            self._thread = None
