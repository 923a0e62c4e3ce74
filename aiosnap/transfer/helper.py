"""The upload process: ``python -m aiosnap.transfer.helper SOCKET_FD ARENA_FD SLAB_BYTES COUNT``.

Started by the trainer (:mod:`.process`) with one end of a Unix socket pair and the staging
arena's memfd. It runs its own asyncio loop (uvloop when installed) with a
:class:`~aiosnap.transfer.local.LocalTransfer` that reads chunks from the shared arena and
owns the storage clients; it imports no torch. It exits when told to close, or as soon as
the trainer is gone (the socket reaches end of file, or -- should a process forked from the
trainer still hold the socket -- it is no longer the trainer's child), so it never outlives
its trainer.
Its own process group keeps a Ctrl-C in the terminal from killing uploads the trainer is
still waiting for; with ``preemption.enabled`` it ignores the preemption signals (a cluster
may send them to every process of the job): the trainer finishes its saves first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from ..config import Config
from ..core.arena import Arena
from ..errors import UploadProcessError
from ..format.placement import Landing
from ..handoff.contract import TransferOutcome
from ..storage.base import Storage
from .local import LocalTransfer
from .protocol import pack_exception

log = logging.getLogger("aiosnap")


class _Reports:
    """The listener of the transfer side: every report goes back over the socket, in order
    (upload process's loop thread)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, *message: Any) -> None:
        try:
            with self.lock:
                self.conn.send(message)
        except OSError:  # the trainer is gone: the command reader sees end of file and stops us
            pass

    def preflight(self, save_id: str, latest: int | None, error: BaseException | None) -> None:
        self.send("preflight", save_id, latest, None if error is None else pack_exception(error))

    def done_with(self, save_id: str, index: int, pieces: Landing | None) -> None:
        self.send("done_with", save_id, index, pieces)

    def sent(self, save_id: str, index: int, nbytes: int) -> None:
        self.send("sent", save_id, index, nbytes)

    def stage_ended(self, save_id: str, stage: str, nbytes: int, seconds: float) -> None:
        self.send("stage", save_id, stage, nbytes, seconds)

    def finished(self, save_id: str, outcome: TransferOutcome) -> None:
        error = None if outcome.error is None else pack_exception(outcome.error)
        self.send("finished", save_id, outcome.committed, error, outcome.deleted_steps, outcome.stage_seconds)


def _dispatch(transfer: LocalTransfer, message: tuple[Any, ...]) -> None:
    """One command, on the loop thread."""
    kind, *args = message
    if kind == "open":
        url, blob = args
        try:
            storage: Storage | None = None if blob is None else pickle.loads(blob)  # noqa: S301 - from our trainer
            transfer.open_root(url, storage)
        except Exception as exc:  # say so at each save to that root
            transfer.cannot_open(url, UploadProcessError(f"the upload process cannot open {url}: {exc!r}"))
    elif kind == "begin":
        transfer.begin(*args)
    elif kind == "staged":
        transfer.staged(args[0])
    elif kind == "may_upload":
        transfer.may_upload(args[0])
    elif kind == "captured":
        transfer.captured(args[0])
    elif kind == "abort":
        transfer.abort(args[0], even_committing=args[1])
    else:
        raise ValueError(f"unknown command {kind!r}")


PARENT_POLL_S = 0.5
"""How often the upload process checks that its trainer is still its parent."""

PING_LAPSE = 2.0
"""Heartbeat intervals without a ping from the trainer after which the upload process stops
writing heartbeats (until the pings come again)."""


async def serve(
    conn: Connection, arena: Arena, config: Config, trainer_pid: int | None = None, scratch_bytes: int = 0
) -> None:
    """Run commands until ``close`` or end of file (the trainer is gone). ``scratch_bytes``:
    the share of the RAM budget the trainer left out of the arena for packing chunks."""
    loop = asyncio.get_running_loop()
    reports = _Reports(conn)
    transfer = LocalTransfer(config, arena, reports, scratch_bytes)
    stop = asyncio.Event()
    gone = False

    pinged = [time.monotonic()]
    lapse = PING_LAPSE * config.distributed.heartbeat_interval
    transfer.trainer_alive = lambda: time.monotonic() - pinged[0] <= lapse

    def read() -> None:  # a reader thread: commands go to the loop in order
        nonlocal gone
        try:
            while True:
                message = conn.recv()
                if message[0] == "close":
                    break
                if message[0] == "ping":  # noted here, so that a busy loop does not hide it
                    pinged[0] = time.monotonic()
                    continue
                loop.call_soon_threadsafe(_dispatch, transfer, message)
        except (EOFError, OSError):
            gone = True
        loop.call_soon_threadsafe(stop.set)

    def watch_trainer() -> None:  # reparented: the trainer died, whoever holds the socket
        nonlocal gone
        while not stop.is_set():
            time.sleep(PARENT_POLL_S)
            if trainer_pid is not None and os.getppid() != trainer_pid:
                gone = True
                loop.call_soon_threadsafe(stop.set)
                return

    threading.Thread(target=read, name="aiosnap-upload-commands", daemon=True).start()
    threading.Thread(target=watch_trainer, name="aiosnap-upload-watch", daemon=True).start()
    reports.send("ready", os.getpid())
    await stop.wait()
    # cancels what still runs: with the trainer gone, nobody waits for it. Its attempts stay
    # (a spooled save is resumed by the next process, into these very folders: removing them
    # now could delete what that process has committed meanwhile); gc removes the others.
    await transfer.close(abandoned=gone)
    if not gone:
        reports.send("closed")


def main(argv: list[str]) -> int:
    socket_fd, arena_fd, slab_bytes, count, scratch_bytes = (int(a) for a in argv)
    logging.basicConfig(level=logging.WARNING, format="aiosnap upload process: %(message)s")
    trainer_pid = os.getppid()
    conn = Connection(socket_fd)
    kind, config = conn.recv()  # the config (secrets included) never goes through argv
    if kind != "config":
        return 2
    if config.preemption.enabled:  # the trainer decides when it ends (and this process with it)
        ignored = [signal.Signals[name] for name in config.preemption.signals]
        for number in ignored:
            signal.signal(number, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, ignored)  # blocked until now (see ProcessTransfer)
    arena = Arena(slab_bytes, count, shared=True, fd=arena_fd)
    try:
        import uvloop

        runner: Any = uvloop.run if config.loop != "asyncio" else asyncio.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(serve(conn, arena, config, trainer_pid, scratch_bytes))
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
