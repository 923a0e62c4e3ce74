"""Preemption: a signal that says "you will be killed soon" (``preemption`` config section).

Clusters announce the end of a job with a signal and a grace period before ``SIGKILL``:
Kubernetes sends ``SIGTERM`` and waits ``terminationGracePeriodSeconds`` (30 by default),
SLURM sends ``SIGTERM`` (or the signal of ``--signal``) and waits ``KillWait``. With
preemption enabled, aiosnap catches those signals for the whole process (one
:class:`Preemption` per process, shared by its checkpointers) and, on the first one:

1. sets :attr:`Preemption.event` (``ckpt.preempted`` is True from then on), so that the
   training loop can take a last save and stop;
2. tells every subscribed checkpointer, which finishes its saves in flight and, with a
   spool, writes the chunks they hold in RAM to the spool disk as well, so that a save
   that cannot finish in time is resumed by the next process;
3. makes the process exit as the signal would have, at the earliest of: the end of the
   grace period, or the interpreter's normal exit (the trainer's main returned). "As the
   signal would have": the disposition that was there before aiosnap's is put back and the
   signal delivered again, so the default action kills the process with that signal (exit
   status 128 + signal number in a shell: 143 for SIGTERM), a handler installed earlier
   (Lightning's, torchelastic's, one installed from C) runs, and an ignored signal stays
   ignored. At the interpreter's exit, the other ``atexit`` functions run first, and a
   handler that ends the process the Python way (``sys.exit(7)``, ``KeyboardInterrupt``)
   gives the exit status it would have given (7; killed by SIGINT).

A child made by ``fork`` (``multiprocessing``'s fork start method, DataLoader workers, a
``Pool``) is not the preempted process: it starts with the dispositions aiosnap replaced
put back (``os.register_at_fork``), so a ``terminate()`` of it ends it as before.

Python runs signal handlers on the main thread only, and only the main thread may install
them: :func:`watch` must be called there (a checkpointer made on another thread joins the
handlers a main-thread one installed, or is refused with a message saying so). The handler
itself only writes a byte to a pipe; a watcher thread (``aiosnap-preemption``) does the
rest, so a signal arriving while the main thread holds any lock cannot deadlock. If the main
thread does not run the re-delivered signal's handler within :data:`EXIT_FALLBACK_S` (it is
stuck in native code), the watcher ends the process with ``os._exit(128 + signal)``.
No torch, no asyncio here.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, NoReturn

from ..errors import ConfigError
from .native_signal import native_disposition, restore_native

__all__ = ["EXIT_FALLBACK_S", "Preemption", "watch"]

log = logging.getLogger("aiosnap")

EXIT_FALLBACK_S = 5.0
"""How long the watcher waits for the main thread to act on the re-delivered signal before
it ends the process itself."""

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Preemption:
    """The process's preemption handling (see the module docstring). Made by :func:`watch`;
    its attributes are read from any thread."""

    def __init__(self, signals: Sequence[signal.Signals], grace_period: float) -> None:
        self.grace_period = grace_period
        self.event = threading.Event()
        """Set once a preemption signal has arrived."""
        self.signal: signal.Signals | None = None
        """The signal that arrived first (None before)."""
        self.deadline: float | None = None
        """``time.monotonic()`` at which the process exits (None before the signal)."""
        self._previous: dict[signal.Signals, _Handler] = {}
        self._native: dict[signal.Signals, bytes] = {}
        """Dispositions installed from C, which ``signal.signal`` cannot put back."""
        self._pid = os.getpid()
        self._subscribers: dict[int, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self._exiting = False
        self._exited = threading.Event()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._thread = threading.Thread(target=self._watch, name="aiosnap-preemption", daemon=True)
        self._thread.start()
        self.add_signals(signals)
        atexit.register(self._at_exit)
        self._atexit_slot = atexit._ncallbacks() - 1
        register_shutdown = getattr(threading, "_register_atexit", None)  # CPython's, since 3.9
        if register_shutdown is not None:
            with contextlib.suppress(RuntimeError):  # the interpreter is exiting already
                register_shutdown(self._run_at_exit_first)

    @property
    def signals(self) -> list[signal.Signals]:
        return list(self._previous)

    @property
    def requested(self) -> bool:
        """True once a preemption signal has arrived."""
        return self.event.is_set()

    def seconds_left(self) -> float | None:
        """Seconds until the process exits (None before the signal)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def add_signals(self, signals: Sequence[signal.Signals]) -> None:
        """Handle ``signals`` too (main thread)."""
        for signum in signals:
            if signum not in self._previous:
                native = native_disposition(signum, signal.getsignal(signum))
                self._previous[signum] = signal.signal(signum, self._on_signal)
                if native is not None:
                    self._native[signum] = native

    def subscribe(self, on_preempted: Callable[[], None]) -> int:
        """Call ``on_preempted()`` (on the watcher thread; it must not block) when the
        signal comes, or at once if it came already; returns a key for :meth:`unsubscribe`."""
        with self._lock:
            key = id(on_preempted)
            self._subscribers[key] = on_preempted
            came = self.event.is_set()
        if came:
            self._tell(on_preempted)
        return key

    def unsubscribe(self, key: int) -> None:
        with self._lock:
            self._subscribers.pop(key, None)

    # -- the signal ----------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The handler (main thread, between two bytecodes of whatever it was running):
        only a byte to the watcher, or, once the exit is due, the exit itself. In a forked
        child that runs it nonetheless (forked without Python's fork hooks), what was there
        before aiosnap's acts."""
        if self._exiting or os.getpid() != self._pid:
            self._deliver(signal.Signals(signum), frame)
            return
        with contextlib.suppress(OSError):  # the pipe is full: the watcher has been told already
            os.write(self._write_fd, bytes([signum]))

    def _watch(self) -> None:
        """The watcher thread: the first signal starts the grace period (later ones find
        the pipe unread, or full: they change nothing); at its end, the exit."""
        try:
            data = os.read(self._read_fd, 1)
        except OSError:
            return
        if not data:
            return
        signum = signal.Signals(data[0])
        if not self._begin(signum):
            log.warning("aiosnap: %s: no checkpointer is open, nothing to finish: exiting now", signum.name)
            self._exit_from_watcher(signum)
            return
        assert self.deadline is not None
        if self._exited.wait(max(0.0, self.deadline - time.monotonic())):
            return  # the interpreter exited first (see _at_exit)
        log.warning(
            "aiosnap: the grace period of %g s is over: exiting as %s would (a save not committed by now, if "
            "kept on the spool, is finished by the next start or `aiosnap resume`)", self.grace_period, signum.name,
        )  # fmt: skip
        self._exit_from_watcher(signum)

    def _begin(self, signum: signal.Signals) -> bool:
        """The preemption starts: False when no checkpointer listens (nothing to finish)."""
        self.signal = signum
        self.deadline = time.monotonic() + self.grace_period
        with self._lock:  # a checkpointer subscribing now is either in this list or told by subscribe()
            subscribers = list(self._subscribers.values())
            self.event.set()
        if not subscribers:
            return False
        log.warning(
            "aiosnap: %s: preempted. Saves in flight are being finished (or kept on the spool disk); "
            "ckpt.preempted is now True: take a last save and stop. The process exits as %s would have "
            "in at most %g s (preemption.grace_period).",
            signum.name, signum.name, self.grace_period,
        )  # fmt: skip
        for subscriber in subscribers:
            self._tell(subscriber)
        return True

    @staticmethod
    def _tell(subscriber: Callable[[], None]) -> None:
        try:
            subscriber()
        except Exception as exc:  # one checkpointer's trouble must not keep the others from hearing
            log.warning("aiosnap: a checkpointer could not react to the preemption: %r", exc)

    # -- the exit ------------------------------------------------------------------------

    def _exit_from_watcher(self, signum: signal.Signals) -> None:
        """Watcher thread: have the main thread deliver the signal again; if it does not
        within :data:`EXIT_FALLBACK_S`, end the process here."""
        self._exiting = True
        os.kill(os.getpid(), signum)  # our handler, on the main thread: see _on_signal
        if self._exited.wait(EXIT_FALLBACK_S):
            return
        if self._previous.get(signum) == signal.SIG_IGN:
            return  # it would have been ignored
        log.error("aiosnap: the main thread did not take the signal in %.0f s; exiting", EXIT_FALLBACK_S)
        logging.shutdown()
        os._exit(128 + int(signum))

    def _run_at_exit_first(self) -> None:
        """Run by ``threading`` as the interpreter begins to exit (main thread, before any
        ``atexit`` function): register :meth:`_at_exit` again, as the last one, so that it
        runs first and can run the others before it ends the process (:meth:`_end`)."""
        if os.getpid() != self._pid:
            return
        atexit.unregister(self._at_exit)
        atexit.register(self._at_exit)
        self._atexit_slot = atexit._ncallbacks() - 1

    def _at_exit(self) -> None:
        """The interpreter exits normally after a preemption (the trainer's main returned,
        its checkpointers closed): exit as the signal would have, now. Main thread."""
        if os.getpid() != self._pid or self._exited.is_set() or self.signal is None:
            return
        signum = self.signal
        previous = self._restore(signum)
        if signum in self._native:  # a handler from C acts (if it returns, the exit goes on)
            self._finish_exit()
            signal.raise_signal(signum)
            return
        if previous == signal.SIG_IGN:
            return  # ignored: the exit goes on
        if not callable(previous):
            self._killed_by(signum)
        try:
            previous(int(signum), None)
        except SystemExit as exc:  # sys.exit() in the handler: the status it asks for
            self._exit_with(_exit_status(exc.code))
        except KeyboardInterrupt:  # Python ends with SIGINT's default action then
            self._killed_by(signal.SIGINT)
        except BaseException:  # uncaught: Python prints it and exits with status 1
            traceback.print_exc()
            self._exit_with(1)

    def _finish_exit(self) -> None:
        """What the interpreter's exit would still do before aiosnap ends the process from
        its ``atexit`` function: the other ``atexit`` functions (once: only when this one
        ran first, see :meth:`_run_at_exit_first`), then flushing logs and streams."""
        if atexit._ncallbacks() - 1 == self._atexit_slot:
            atexit._run_exitfuncs()  # _at_exit among them returns at once: _exited is set
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()

    def _killed_by(self, signum: signal.Signals) -> NoReturn:
        self._finish_exit()
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)
        os._exit(128 + int(signum))  # not reached: these signals' default action ends the process

    def _exit_with(self, status: int) -> NoReturn:
        self._finish_exit()
        os._exit(status)

    def _deliver(self, signum: signal.Signals, frame: FrameType | None) -> None:
        """Main thread: put back the dispositions aiosnap replaced, and act on ``signum`` as
        the one before aiosnap's would have (kill, call it, or ignore)."""
        previous = self._restore(signum)
        if signum in self._native or previous == signal.SIG_DFL:
            logging.shutdown()  # what was logged reaches its files before the default action ends us
            signal.raise_signal(signum)
        elif callable(previous):
            previous(int(signum), frame)

    def _restore(self, signum: signal.Signals) -> _Handler:
        """Put back the dispositions aiosnap replaced (main thread); returns the one of
        ``signum`` from before (SIG_DFL when Python saw none)."""
        self._exited.set()
        self._put_back()
        previous = self._previous.get(signum)
        return signal.SIG_DFL if previous is None else previous

    def _put_back(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
            native = self._native.get(signum)
            if native is not None:
                restore_native(signum, native)

    def _leave_in_child(self) -> None:
        """A forked child (its only thread, right after the fork): it is not the process
        being preempted. Its signals act as before aiosnap's; the watcher's pipe is closed."""
        self._subscribers.clear()
        self._put_back()
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def _exit_status(code: object) -> int:
    """The exit status ``SystemExit(code)`` gives (a message is printed, as Python does)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


_process: Preemption | None = None
_process_lock = threading.Lock()


def watch(signal_names: Sequence[str], grace_period: float) -> Preemption:
    """The process's :class:`Preemption`, handling ``signal_names`` (made, or extended, on
    the main thread; ``grace_period``: the shortest asked for wins). Raises
    :class:`~aiosnap.errors.ConfigError` on another thread unless the main thread already
    handles those signals."""
    global _process
    signals = [signal.Signals[name] for name in signal_names]
    on_main = threading.current_thread() is threading.main_thread()
    with _process_lock:
        if not on_main and (_process is None or not set(signals) <= set(_process.signals)):
            raise ConfigError(
                f"preemption.enabled: Python installs signal handlers only on the main thread, and this "
                f"checkpointer is made on thread {threading.current_thread().name!r}; make it (or one "
                f"checkpointer with the same preemption settings) on the main thread first"
            )
        if _process is None:
            _process = Preemption(signals, grace_period)
        else:
            if on_main:
                _process.add_signals(signals)
            _process.grace_period = min(_process.grace_period, grace_period)
        return _process


_fork_mask: set[int | signal.Signals] | None = None
"""The forking thread's signal mask before :func:`_before_fork` blocked the preemption
signals (None when it did not)."""


def _before_fork() -> None:
    """``os.register_at_fork`` (the forking thread): block the preemption signals across
    the fork, so that one sent to the child before :func:`_after_fork_in_child` has put its
    dispositions back waits for that (Python would drop it: a child forgets the signals its
    handlers had not run yet) and then acts as it would have."""
    global _fork_mask
    process = _process
    if process is not None and process.signals and os.getpid() == process._pid:
        _fork_mask = signal.pthread_sigmask(signal.SIG_BLOCK, process.signals)


def _unblock() -> None:
    global _fork_mask
    mask, _fork_mask = _fork_mask, None
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _after_fork_in_child() -> None:
    """``os.register_at_fork``: a forked child has no preemption of its own (a checkpointer
    made in it sets one up afresh); the parent's handlers and pipe are left behind, and a
    signal it got meanwhile acts now."""
    global _process, _process_lock
    _process_lock = threading.Lock()
    process, _process = _process, None
    if process is not None:
        process._leave_in_child()
    _unblock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_unblock, after_in_child=_after_fork_in_child)
