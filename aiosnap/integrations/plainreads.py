"""Plain reads of a checkpoint path wait for its save in flight, in the thread that saved it.

A training script that calls ``trainer.save_checkpoint(path)`` and then ``torch.load(path)``
(or ``LightningModule.load_from_checkpoint(path)``, ``shutil.copy(path, ...)``, a logger
uploading the file) reads the file before the background save has committed it. In the thread
that made the save, in the process that made it, such a read now waits for the save first,
as the plugin's own ``load_checkpoint`` does: every ``open()`` or ``os.open()`` of a path for
reading passes an *audit hook* (:func:`sys.addaudithook`, PEP 578) that, when this thread has
a save to that very path in flight, waits until the save has committed (or failed, and was
cleaned up after), then lets the open go on; it then opens the committed file. Only for saves
of an ``AiosnapCheckpointIO(plain_reads_wait=True)``: off by default, since it makes the
background save synchronous for whatever the trainer thread reads (a logger copying each
checkpoint in a hook). The first read that waits for a save logs a warning naming the path; a
save that does not settle within ``plain_reads_timeout`` seconds makes the ``open`` raise
:class:`~aiosnap.errors.PlainReadTimeoutError` naming the path.

What it never does: wait in any other thread (aiosnap's own threads read the file while they
commit it; a logger's upload thread gets the previous version, or the placeholder's error
during a first save), in a forked child (a DataLoader worker), for a write, for an open of a
file descriptor, or for a path with no save of this thread in flight. A path given as bytes
counts as its decoded name; ``os.open(name, dir_fd=fd)`` of a relative ``name`` is taken
relative to the current directory, as every relative path (the audit event does not carry
``dir_fd``). Python keeps an audit hook for the life of the process; once no such save is in
flight it costs one function call and one string compare per audit event. Saves without the
opt-in never make reads wait (and never install the hook).

Threads: the hook runs in whichever thread opens a file.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from .inflight import wait_for_own_save

__all__ = ["install"]

_installed = False
_install_lock = threading.Lock()
_WRITING = os.O_WRONLY | os.O_RDWR


def install() -> None:
    """Make plain reads wait (see the module docstring); once per process."""
    global _installed
    with _install_lock:
        if not _installed:
            sys.addaudithook(_on_audit_event)
            _installed = True


def _on_audit_event(event: str, args: tuple[Any, ...]) -> None:
    """Any thread: an ``open`` for reading of a path whose save this thread made waits
    (:class:`~aiosnap.errors.PlainReadTimeoutError` out of the ``open`` if it waits too long)."""
    if event != "open":
        return
    path, _, flags = args
    if type(path) not in (str, bytes) or not isinstance(flags, int) or flags & _WRITING:
        return
    try:
        text = os.fsdecode(path)
        where = text if os.path.isabs(text) else os.path.abspath(text)
    except Exception:  # a path it cannot make sense of: the open goes on as without the hook
        return
    wait_for_own_save(where)
