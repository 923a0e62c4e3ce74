"""A process with aiosnap's preemption handling (:mod:`aiosnap.core.preemption`, without a
checkpointer, so without torch: it starts in a tenth of a second), run by
test_preemption.py to see how it ends. Each scenario signals itself, and a subscriber
stands for a checkpointer (what one does on the signal is tested with real ones there).

argv: scenario. Scenarios:

- ``fork``: a forked ``multiprocessing`` child is terminated (prints TERMINATED <exit
  code>), a forked ``Pool`` is used and left (POOL), then PREEMPTED <bool>; then this
  process takes SIGTERM, and a child forked after it exits normally (FORKED <status>);
  this process returns, and is to end as SIGTERM would;
- ``sigint``: preemption on SIGINT, Python's own handler before aiosnap's; returns;
- ``sysexit``: a handler installed before calls ``sys.exit(7)``; returns;
- ``raises``: a handler installed before raises RuntimeError; returns;
- ``native``: a handler installed before from C (libc's ``_exit``: status 15); returns;
- ``native-grace``: the same, but the process never returns: the grace period (0.5 s) ends it.

Every scenario but ``fork`` registers an ``atexit`` function before and one after the
preemption handling, each printing ATEXIT <which>: both are to run, once.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import os
import signal
import sys
import time

from aiosnap.core.preemption import Preemption, watch

DEADLINE_S = 30.0


def _preempt_myself(preemption: Preemption, signum: signal.Signals) -> None:
    os.kill(os.getpid(), signum)
    deadline = time.monotonic() + DEADLINE_S
    while not preemption.requested:
        assert time.monotonic() < deadline, "the signal never came"
        time.sleep(0.005)


def _sleep_until_terminated() -> None:
    time.sleep(DEADLINE_S)


def _forks() -> None:
    preemption = watch(["SIGTERM"], DEADLINE_S)
    preemption.subscribe(lambda: None)
    forking = multiprocessing.get_context("fork")
    child = forking.Process(target=_sleep_until_terminated, daemon=True)
    child.start()
    child.terminate()
    child.join(DEADLINE_S)
    print(f"TERMINATED {child.exitcode}", flush=True)
    with forking.Pool(2) as pool:  # leaving it terminates its workers (SIGTERM)
        print(f"POOL {pool.map(abs, [-1, -2])}", flush=True)
    print(f"PREEMPTED {preemption.requested}", flush=True)
    _preempt_myself(preemption, signal.SIGTERM)
    pid = os.fork()
    if pid == 0:  # a child of a preempted process: it exits normally (its atexit functions run)
        sys.exit(0)
    print(f"FORKED {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}", flush=True)


def _handler_before(scenario: str) -> None:
    if scenario == "sysexit":

        def exits(signum: int, frame: object) -> None:
            print("PREVIOUS HANDLER", flush=True)
            sys.exit(7)

        signal.signal(signal.SIGTERM, exits)
    elif scenario == "raises":

        def raises(signum: int, frame: object) -> None:
            raise RuntimeError("raised by the handler from before")

        signal.signal(signal.SIGTERM, raises)
    elif scenario.startswith("native"):
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(signal.SIGTERM, ctypes.cast(libc._exit, ctypes.c_void_p).value)


def main(scenario: str) -> None:
    if scenario == "fork":
        _forks()
        return
    atexit.register(print, "ATEXIT before", flush=True)
    _handler_before(scenario)
    signum = signal.SIGINT if scenario == "sigint" else signal.SIGTERM
    preemption = watch([signum.name], 0.5 if scenario == "native-grace" else DEADLINE_S)
    preemption.subscribe(lambda: None)
    atexit.register(print, "ATEXIT after", flush=True)
    _preempt_myself(preemption, signum)
    print("RETURNING", flush=True)
    if scenario == "native-grace":
        time.sleep(DEADLINE_S)


if __name__ == "__main__":
    main(sys.argv[1])
