"""The transfer side in an upload process (``upload.executor: process``), seen from the trainer.

:class:`ProcessTransfer` starts ``python -m aiosnap.transfer.helper`` (a fresh interpreter,
not a fork: nothing of the training process is inherited but the staging arena's memfd and
one end of a Unix socket pair; no TCP port) when the checkpointer starts, and is the
trainer's :class:`~aiosnap.handoff.contract.Transfer`: each call becomes one small message. A reader
thread turns the upload process's reports into calls on the trainer's loop. When the upload
process dies (killed, out of memory), the socket reaches end of file at once: the saves it
had fail with :class:`~aiosnap.errors.UploadProcessError` and the next save starts a new one.
Once a multi-rank save has begun, the trainer's loop pings the upload process every half
``heartbeat_interval``: the upload process writes a rank's heartbeat only while the pings
come (:data:`~.helper.PING_LAPSE`), so a trainer that is stopped or wedged is named by the
other ranks like a dead one, not kept alive by its helper.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import Any

from ..config import Config
from ..core.arena import Arena
from ..errors import ConfigError, UploadProcessError
from ..format.spec import SaveSpec
from ..handoff.contract import Staged, TransferListener, TransferOutcome
from ..storage.base import Storage
from .protocol import unpack_exception

__all__ = ["ProcessTransfer"]

log = logging.getLogger("aiosnap")

READER_GRACE_S = 1.0
"""How long a failed send waits for the reader thread to queue the dead process's last
reports (it reaches end of file at once when the process is gone)."""

CLOSE_WAIT_S = 30.0
"""How long closing waits for the upload process to finish and exit before killing it."""


_live: weakref.WeakSet[ProcessTransfer] = weakref.WeakSet()


def _forget_in_forked_child() -> None:
    """A child forked from the trainer (a DataLoader or multiprocessing worker) must not hold
    the trainer's end of the socket: the upload process exits when that end closes."""
    for transfer in list(_live):
        transfer.drop_after_fork()


os.register_at_fork(after_in_child=_forget_in_forked_child)


_PF_EXITING = 0x4
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def _dying(pid: int) -> bool:
    """Whether process ``pid`` (a child not reaped yet) is on its way out although it has
    not exited: killed (SIGKILL pending), exiting, or a zombie whose other threads still
    end (a process with torch's address space takes ~10 ms to die). Linux's
    ``/proc/<pid>/stat``; elsewhere (or unreadable) False: its exit status tells."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        state, flags, pending = fields[0], int(fields[6]), int(fields[28])
    except (OSError, IndexError, ValueError):
        return False
    return state in (b"Z", b"X", b"x") or bool(flags & _PF_EXITING) or bool(pending & _SIGKILL_BIT)


def _storage_blob(storage: Storage | None, config: Config) -> bytes | None:
    """How the upload process gets a root's backend: by URL when it would build the same
    one from the URL and ``config``, else the backend itself, pickled (it must pickle: it
    runs in another process)."""
    from ..storage.local import LocalStorage

    if storage is None or type(storage) is LocalStorage:
        return None
    try:
        from ..storage.s3 import S3Storage

        if (
            type(storage) is S3Storage
            and storage.config == config.s3
            and storage.concurrency == config.upload.concurrency
        ):
            return None
    except ImportError:
        pass
    try:
        return pickle.dumps(storage)
    except Exception as exc:
        raise ConfigError(
            f"upload.executor: process needs a storage the upload process can open: {storage.url} is a "
            f"{type(storage).__name__}, which cannot be pickled ({exc}); use upload.executor: thread"
        ) from None


class ProcessTransfer:
    """The trainer's handle on its upload process. Methods run on the trainer's loop thread;
    ``listener`` (the engine) hears the reports there."""

    def __init__(self, config: Config, arena: Arena, listener: TransferListener, scratch_bytes: int = 0) -> None:
        self.arena = arena
        self.listener = listener
        self.dead: UploadProcessError | None = None
        self.ready = False
        """The upload process said it serves (imported, its loop running): until then a save's
        look at the root waits for it to start (see :meth:`TransferLink.look_meanwhile`)."""
        self._lost_reported = False
        self._loop = asyncio.get_running_loop()
        self._opened: set[str] = set()
        self._closed = self._loop.create_future()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The preemption signals are blocked in the new process from its first instruction
        # (a blocked set survives exec) until it ignores them: one that arrives while it starts
        # (a cluster signals every process of the job) waits, and is then ignored.
        blocked = [signal.Signals[name] for name in config.preemption.signals] if config.preemption.enabled else []
        before = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "aiosnap.transfer.helper", str(theirs.fileno()), str(arena.fd),
                 str(arena.slab_bytes), str(arena.count), str(scratch_bytes)],
                pass_fds=(theirs.fileno(), arena.fd), stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._pinger: asyncio.Task[None] | None = None
        self.config = config
        self._reader = threading.Thread(target=self._read, name="aiosnap-upload-reports", daemon=True)
        self._reader.start()
        _live.add(self)
        self._send("config", config)

    def drop_after_fork(self) -> None:
        """In a forked child: close this process's copy of the socket, touch nothing else."""
        with contextlib.suppress(OSError):
            self._conn.close()  # this process's copy only: nothing is sent

    def kill(self) -> None:
        """Kill the upload process (it does not answer); its end of file follows, and with it
        the failure of every save it had. Loop thread."""
        if self._process.poll() is None:
            self._process.kill()

    def alive(self) -> bool:
        """Whether the upload process still serves: False once it is known gone, also when it
        died while idle and the reader thread's end of file has not reached this loop yet (a
        save submitted in that moment goes to a new process, as the log promises). Loop thread."""
        if self.dead is None and (self._process.poll() is not None or _dying(self._process.pid)):
            self._process.kill()  # (dying already: this only makes sure)
            self.dead = UploadProcessError(f"the upload process (pid {self._process.pid}) died while idle")
        return self.dead is None

    @property
    def pid(self) -> int:
        return self._process.pid

    def _send(self, *message: Any) -> None:
        """Loop thread. A broken socket means the upload process is gone: this operation
        fails at once, the next save starts a new one (``dead`` is set); the saves it had
        fail when the reader thread reaches end of file, after every report the process
        sent before it died (a save it committed stays committed). The reader gets a moment
        to get there, so that those reports are queued on the loop before anything else."""
        if self.dead is not None:
            raise self.dead
        try:
            with self._send_lock:
                self._conn.send(message)
        except OSError as exc:
            log.debug("aiosnap: sending to the upload process failed: %r", exc)
            self.dead = UploadProcessError(f"the upload process (pid {self._process.pid}) is gone: {exc}")
            self._reader.join(READER_GRACE_S)
            raise self.dead from None

    def _read(self) -> None:
        """The reader thread: reports, in order, onto the trainer's loop; then the end."""
        try:
            while True:
                message = self._conn.recv()
                self._deliver(self._report, message)
                if message[0] == "closed":
                    return
        except (EOFError, OSError):
            pass
        self._deliver(self._lost)

    def _deliver(self, callback: Any, *args: Any) -> None:
        """Reader thread: hand one report (or the end) to the trainer's loop, in order."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens any more
            self._loop.call_soon_threadsafe(callback, *args)

    def _report(self, message: tuple[Any, ...]) -> None:
        kind, *args = message
        if kind == "ready":
            self.ready = True
        elif kind == "preflight":
            save_id, latest, error = args
            self.listener.preflight(save_id, latest, None if error is None else unpack_exception(error))
        elif kind == "done_with":
            self.listener.done_with(*args)
        elif kind == "sent":
            self.listener.sent(*args)
        elif kind == "stage":
            self.listener.stage_ended(*args)
        elif kind == "finished":
            save_id, committed, error, deleted, stages = args
            outcome = TransferOutcome(
                committed, None if error is None else unpack_exception(error), tuple(deleted), dict(stages)
            )
            self.listener.finished(save_id, outcome)
        elif kind == "closed" and not self._closed.done():
            self._closed.set_result(None)

    def _lost(self) -> None:
        """The socket reached end of file: the upload process exited or was killed."""
        if not self._closed.done():
            self._closed.set_result(None)
        if self._lost_reported:
            return
        self._lost_reported = True
        code = self._process.poll()
        if code is None:  # it closed the socket but lives on: it is of no use any more
            self._process.kill()
            code = self._process.wait()
        error = UploadProcessError(
            f"the upload process (pid {self._process.pid}) died (exit status {code}); "
            "its saves failed, spooled chunks stay for resume, the next save starts a new one"
        )
        if self.dead is None:
            self.dead = error
        log.error("aiosnap: %s", error)
        lost = getattr(self.listener, "transfer_lost", None)
        if lost is not None:
            lost(error, self)

    # -- Transfer ----------------------------------------------------------------------------

    def open_root(self, url: str, storage: Storage | None = None) -> None:
        if url not in self._opened:
            self._send("open", url, _storage_blob(storage, self.config))
            self._opened.add(url)

    def begin(self, save_id: str, url: str, keep_last: int | None, spec: SaveSpec) -> None:
        if spec.distributed is not None and self._pinger is None:
            self._send("ping")
            self._pinger = self._loop.create_task(self._ping())
        self._send("begin", save_id, url, keep_last, spec)

    async def _ping(self) -> None:
        """Show the upload process that this trainer is alive, until it is gone (loop thread)."""
        while self.dead is None:
            await asyncio.sleep(self.config.distributed.heartbeat_interval / 2)
            try:
                self._send("ping")
            except UploadProcessError:
                return

    def staged(self, chunk: Staged) -> None:
        self._send("staged", chunk)

    def may_upload(self, save_id: str) -> None:
        self._send("may_upload", save_id)

    def captured(self, save_id: str) -> None:
        self._send("captured", save_id)

    def abort(self, save_id: str, *, even_committing: bool = False) -> None:
        if self.dead is None:
            self._send("abort", save_id, even_committing)

    async def close(self) -> None:
        """Ask the upload process to finish and exit; wait (bounded), then reap it."""
        if self._pinger is not None:
            self._pinger.cancel()
        if self.dead is None:
            try:
                self._send("close")
                await asyncio.wait_for(asyncio.shield(self._closed), CLOSE_WAIT_S)
            except (UploadProcessError, TimeoutError):
                pass
        await asyncio.to_thread(self._reap)
        self._conn.close()

    def _reap(self) -> None:
        deadline = time.monotonic() + CLOSE_WAIT_S
        while self._process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._process.poll() is None:
            log.warning("aiosnap: the upload process did not exit; killing it")
            self._process.kill()
        self._process.wait()
        self._reader.join(CLOSE_WAIT_S)
