"""How far a save has got, as it runs: a snapshot any thread can read.

A :class:`ProgressTracker` per save is updated by aiosnap's loop thread as the save goes
(waiting for a slot, bytes captured into RAM staging or the spool, bytes uploaded, the
stage) and read from any thread as a frozen :class:`SaveProgress` (``handle.progress()``).
A :class:`ProgressBoard` holds the trackers of the saves in flight (for a live display).

Uploads report bytes as they go, not only when a whole chunk has landed: a storage backend
calls :func:`report_sent` as each request of a write completes (an S3 part, a piece of a
local file), and whoever runs the write sets where those reports go around it
(:func:`counting_sent`). The counter rides on a context variable, so it reaches through
wrappers (fault injection, the single-file storage) and into the tasks a write starts.
No torch and no I/O here: the upload process uses it too.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

__all__ = ["ProgressBoard", "ProgressTracker", "SaveProgress", "Stage", "counting_sent", "report_sent"]

Stage = Literal["waiting", "capturing", "uploading", "committing", "committed", "failed", "cancelled"]
"""Where a save is: ``waiting`` for a pending-save slot (``max_pending_saves``),
``capturing`` (``save()`` has not returned), ``uploading``, ``committing`` (every chunk is
in storage; the manifest is being written, then retention), or over."""

ENDED: frozenset[Stage] = frozenset({"committed", "failed", "cancelled"})

MiB = 1024 * 1024


@dataclass(frozen=True)
class SaveProgress:
    """One save's progress at one moment. Byte counts are of the state's bytes (not of the
    padding and headers its data objects add), never exceed ``total_bytes`` and only grow;
    ``captured_bytes`` reaches ``total_bytes`` when ``save()`` returns, ``uploaded_bytes``
    once every chunk has landed, before the commit."""

    step: int
    stage: Stage
    total_bytes: int
    """Bytes of the state this save writes."""
    captured_bytes: int
    """Copied out of the state, into RAM staging or onto the spool disk."""
    staged_bytes: int
    """Of the captured bytes, those copied into RAM staging slabs."""
    spooled_bytes: int
    """Bytes written to the local-disk spool (spilled during capture, or written there to
    survive a preemption)."""
    uploaded_bytes: int
    """In storage (chunks landed, and the requests of chunks still on their way; those of a
    chunk given up when its save failed stay counted)."""
    elapsed_s: float
    """Seconds since ``save()`` was called (until the save ended, once it has)."""
    upload_rate: float | None
    """Bytes per second uploaded so far, from the first byte sent (None before it)."""

    @property
    def done(self) -> bool:
        """True once the save has committed, failed or was cancelled."""
        return self.stage in ENDED

    @property
    def fraction(self) -> float:
        """Share of the bytes uploaded (1.0 for a committed save of no bytes)."""
        if self.total_bytes == 0:
            return 1.0 if self.stage == "committed" else 0.0
        return self.uploaded_bytes / self.total_bytes

    def describe(self) -> str:
        """One human line: ``step 200 uploading: 120.5 of 503.0 MiB uploaded (41.0 MiB/s)``."""
        line = (
            f"step {self.step} {self.stage}: {self.uploaded_bytes / MiB:.1f} of "
            f"{self.total_bytes / MiB:.1f} MiB uploaded"
        )
        if self.upload_rate:
            line += f" ({self.upload_rate / MiB:.1f} MiB/s)"
        return line


class ProgressTracker:
    """The progress of one save: updated by the loop thread, read by any thread (a lock
    keeps each snapshot consistent; updates are a few additions). Callers count a chunk by
    the state's bytes in it (:attr:`~aiosnap.trainer.chunks.Chunk.payload`)."""

    def __init__(self, step: int, total_bytes: int, started: float | None = None) -> None:
        self.step = step
        self.total_bytes = total_bytes
        self._started = time.perf_counter() if started is None else started
        self._lock = threading.Lock()
        self._stage: Stage = "waiting"
        self._captured = 0
        self._staged = 0
        self._spooled = 0
        self._landed = 0
        self._sending: dict[int, int] = {}  # chunk -> bytes of it sent, not landed yet
        self._given_up = 0  # bytes sent of chunks dropped before they landed
        self._first_captured: float | None = None
        self._uploading_at: float | None = None
        self._first_sent: float | None = None
        self._last_sent: float | None = None
        self._ended: float | None = None

    def stage(self, stage: Stage) -> None:
        """The save moved on to ``stage`` (an ended save stays ended)."""
        with self._lock:
            if self._stage in ENDED:
                return
            self._stage = stage
            if stage == "uploading" and self._uploading_at is None:
                self._uploading_at = time.perf_counter()
            if stage in ENDED:
                self._ended = time.perf_counter()

    def captured(self, nbytes: int, *, spooled: bool) -> None:
        """A chunk of ``nbytes`` is captured: in a RAM slab, or (``spooled``) on the spool."""
        with self._lock:
            if self._first_captured is None:
                self._first_captured = time.perf_counter()
            self._captured += nbytes
            if spooled:
                self._spooled += nbytes
            else:
                self._staged += nbytes

    def spooled(self, nbytes: int) -> None:
        """A chunk held in RAM was also written to the spool (to survive a preemption)."""
        with self._lock:
            self._spooled += nbytes

    def sending(self, chunk: int, nbytes: int, limit: int) -> None:
        """``nbytes`` more of chunk ``chunk`` (of ``limit`` bytes) reached storage."""
        with self._lock:
            self._sending[chunk] = min(limit, self._sending.get(chunk, 0) + nbytes)
            self._sent_now()

    def landed(self, chunk: int, nbytes: int) -> None:
        """Chunk ``chunk`` (``nbytes``) is in storage."""
        with self._lock:
            self._sending.pop(chunk, None)
            self._landed += nbytes
            self._sent_now()

    def dropped(self, chunk: int) -> None:
        """Chunk ``chunk`` will not be uploaded (its save is over); what of it was sent
        stays counted (counts only grow)."""
        with self._lock:
            self._given_up += self._sending.pop(chunk, 0)

    def _sent_now(self) -> None:
        now = time.perf_counter()
        if self._first_sent is None:
            self._first_sent = now
        self._last_sent = now

    def snapshot(self) -> SaveProgress:
        """The progress now (any thread)."""
        with self._lock:
            now = self._ended if self._ended is not None else time.perf_counter()
            total = self.total_bytes
            uploaded = min(total, self._landed + self._given_up + sum(self._sending.values()))
            rate = None
            if self._first_sent is not None and self._last_sent is not None:
                window = (now if self._ended is None else self._last_sent) - self._upload_began(self._first_sent)
                rate = uploaded / window if window > 0 else None
            return SaveProgress(
                step=self.step,
                stage=self._stage,
                total_bytes=total,
                captured_bytes=min(total, self._captured),
                staged_bytes=min(total, self._staged),
                spooled_bytes=min(total, self._spooled),
                uploaded_bytes=uploaded,
                elapsed_s=now - self._started,
                upload_rate=rate,
            )

    def _upload_began(self, first_sent: float) -> float:
        """When uploading began. Not when the first bytes were reported: a request reports
        once it has completed, so timing from it would count its bytes in no time (a rate
        many times the real one). Uploads start once capture is over, or earlier when it
        would wait for RAM (then the first chunk's capture is the earliest they can have)."""
        if self._uploading_at is not None and self._uploading_at <= first_sent:
            return self._uploading_at
        return self._first_captured if self._first_captured is not None else self._started


class ProgressBoard:
    """The trackers of the saves in flight (the loop thread adds and removes them; any
    thread reads them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: list[ProgressTracker] = []

    def add(self, tracker: ProgressTracker) -> None:
        with self._lock:
            self._live.append(tracker)

    def discard(self, tracker: ProgressTracker) -> None:
        with self._lock:
            if tracker in self._live:
                self._live.remove(tracker)

    def snapshots(self) -> list[SaveProgress]:
        """The progress of every save in flight, oldest first."""
        with self._lock:
            live = list(self._live)
        return [tracker.snapshot() for tracker in live]


_sent: contextvars.ContextVar[Callable[[int], None] | None] = contextvars.ContextVar("aiosnap_sent", default=None)


def report_sent(nbytes: int) -> None:
    """A storage backend sent ``nbytes`` more of the write under way (one request of it
    completed): tell the counter set around that write, if any. Loop thread."""
    counter = _sent.get()
    if counter is not None and nbytes > 0:
        counter(nbytes)


@contextmanager
def counting_sent(counter: Callable[[int], None]) -> Iterator[None]:
    """Around a write (in a coroutine on the loop thread): :func:`report_sent` calls made by
    it, and by the tasks it starts, go to ``counter``."""
    token = _sent.set(counter)
    try:
        yield
    finally:
        _sent.reset(token)
