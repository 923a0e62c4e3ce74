"""Each background failure is reported once.

A save that fails in the background hands its exception to a :class:`FailureLedger`. The
caller sees it, with its original type, at the first of: ``await handle`` /
``handle.wait()`` (which marks it observed), the next ``save()`` (which raises it instead
of starting a save), or ``close()``. A failure already observed is never raised again by
``save()`` or ``close()``. Thread-safe: the loop thread records failures, callers' threads
observe and take them.
"""

from __future__ import annotations

import threading

__all__ = ["FailureLedger"]


class FailureLedger:
    """Failures of background saves that nobody has been told about yet, oldest first.

    The loop thread records a failure *before* it completes the save's handle with it, so
    a caller can never observe a failure that is recorded afterwards."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unobserved: list[BaseException] = []

    def record(self, failure: BaseException) -> None:
        """A save failed after ``save()`` returned (loop thread)."""
        with self._lock:
            self._unobserved.append(failure)

    def observed(self, failure: BaseException) -> None:
        """The caller received ``failure`` from its handle (any thread)."""
        with self._lock:
            self._unobserved = [f for f in self._unobserved if f is not failure]

    def take(self) -> BaseException | None:
        """The oldest failure nobody has seen, now counted as reported (any thread)."""
        with self._lock:
            return self._unobserved.pop(0) if self._unobserved else None

    def take_all(self) -> list[BaseException]:
        """Every failure nobody has seen, now counted as reported (any thread)."""
        with self._lock:
            failures, self._unobserved = self._unobserved, []
            return failures
