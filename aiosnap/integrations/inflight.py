"""Saves in flight in this process, by checkpoint path, and what stands at a path meanwhile.

Whichever :class:`~aiosnap.integrations.lightning.AiosnapCheckpointIO` made a save, every
reader of its path in this process can wait for it (:func:`wait_for_checkpoint`, another
plugin instance, ``Trainer(ckpt_path=...)``, and plain reads by the thread that saved it:
:mod:`.plainreads`). A local path whose first save is in flight
holds a *placeholder* (:mod:`aiosnap.format.placeholder`): ``os.path.exists`` and Lightning's
checks see a file, and a plain ``torch.load`` of it raises an error saying that the save is
still running and how to wait for it. If that save fails, the placeholder goes again.

Threads: any (the trainer's, aiosnap's loop thread through done-callbacks, the plugin's
remover); one lock guards the tables.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpointer import SyncSaveHandle
from ..core.redact import shown_url
from ..errors import PlainReadTimeoutError
from ..format.placeholder import MAX_PLACEHOLDER_BYTES, placeholder_bytes, placeholder_message

__all__ = [
    "is_local",
    "key_of",
    "location_of",
    "make_placeholder",
    "placeholder_at",
    "remove_if_empty",
    "save_not_started",
    "take_failed",
    "track",
    "wait_for_checkpoint",
    "wait_for_own_save",
]

log = logging.getLogger("aiosnap")


@dataclass(eq=False)
class _Save:
    handle: SyncSaveHandle
    read_timeout: float | None  # plain reads by the thread that saved wait this long for it, None: not at all
    settled: threading.Event = field(default_factory=threading.Event)  # ended, and cleaned up after
    thread: int = field(default_factory=threading.get_ident)
    pid: int = field(default_factory=os.getpid)  # a forked child's copy never settles: never waited for
    read_waited: bool = False  # a plain read has waited for it (and said so, once)


_lock = threading.RLock()
_in_flight: dict[str, list[_Save]] = {}
"""Saves in flight, by key (:func:`key_of`), whichever plugin made them."""
_placeholders: dict[str, tuple[int, int, int]] = {}
"""Placeholders this process put at paths: key -> (st_dev, st_ino, size)."""
_failed: set[str] = set()
"""Local paths whose latest save failed: what was made for them goes at teardown if empty."""
_watched: frozenset[str] = frozenset()
"""File names (the last part) of the keys that have saves whose plain reads wait: a cheap
first filter for :func:`wait_for_own_save`, read without the lock."""
_claimed: set[str] = set()
"""Paths whose placeholder a save about to start relies on (from :func:`make_placeholder`
to :func:`track`): a failed earlier save does not take it away meanwhile."""
_owner = os.getpid()
"""The process whose saves the tables hold."""


def _forget_the_parent() -> None:
    """In a child just forked (before anything else runs there): empty tables and a new
    lock. The parent's saves never settle in the child, and the lock may have been taken by
    one of the parent's threads, which the child does not have: it would never be released."""
    global _lock, _watched, _owner
    _lock = threading.RLock()
    _in_flight.clear()
    _placeholders.clear()
    _failed.clear()
    _claimed.clear()
    _watched = frozenset()
    _owner = os.getpid()


os.register_at_fork(after_in_child=_forget_the_parent)


def is_local(key: str) -> bool:
    return "://" not in key


def location_of(path: str | os.PathLike[str]) -> str:
    """A Lightning checkpoint path as given: URLs as they are, local paths absolute (not
    resolved: the path may be a symlink)."""
    text = os.fspath(path)
    if "://" in text:
        return text.rstrip("/")
    return str(Path(text).expanduser().absolute())


def key_of(path: str | os.PathLike[str]) -> str:
    """The storage root for a Lightning checkpoint path, one spelling per folder: URLs as
    given, local paths with every symlink resolved (saves, loads and removals of one folder
    reached through different links meet)."""
    where = location_of(path)
    return os.path.realpath(where) if is_local(where) else where


def track(key: str, handle: SyncSaveHandle, *, read_timeout: float | None = None) -> None:
    """Remember a save to ``key`` until it ends (the caller's thread, which made it: with a
    ``read_timeout``, its plain reads of ``key`` wait for it up to that many seconds, see
    :mod:`.plainreads`)."""
    save = _Save(handle, read_timeout)
    with _lock:
        _in_flight[key] = [*_unsettled(key), save]
        _claimed.discard(key)
        _rewatch()
    handle.future.add_done_callback(lambda _: _settled(key, save))


def _rewatch() -> None:
    """With the lock held: recompute :data:`_watched`."""
    global _watched
    waited_for = (key for key, saves in _in_flight.items() if any(s.read_timeout is not None for s in saves))
    _watched = frozenset(os.path.basename(key) for key in waited_for)


def wait_for_own_save(path: str) -> None:
    """Any thread, from inside an ``open`` of ``path`` for reading: if this thread made saves
    to ``path`` that are in flight (and asked for it), wait until they settle, saying so once
    per save; :class:`~aiosnap.errors.PlainReadTimeoutError` naming ``path`` when one has not
    after its ``read_timeout``."""
    if os.path.basename(path) not in _watched or os.getpid() != _owner:  # no lock taken: a forked child
        return
    key = os.path.realpath(path)
    me = threading.get_ident()
    with _lock:
        mine = [s for s in _unsettled(key) if s.read_timeout is not None and s.thread == me and s.pid == _owner]
    for save in mine:
        assert save.read_timeout is not None
        if save.settled.is_set():
            continue
        if not save.read_waited:
            save.read_waited = True
            log.warning(
                "aiosnap: a read of %s by the thread that saved it waits (up to %g s) for that save to commit "
                "(AiosnapCheckpointIO(plain_reads_wait=True))",
                path,
                save.read_timeout,
            )
        if not save.settled.wait(save.read_timeout):
            raise PlainReadTimeoutError(
                f"{path}: the save to it made by this thread has not committed after {save.read_timeout:g} s, "
                "so this read (plain_reads_wait=True) gives up; raise plain_reads_timeout, or call "
                "wait_for_checkpoint(path) before reading"
            )


def save_not_started(key: str) -> None:
    """The save :func:`make_placeholder` was called for was refused before it started: its
    placeholder goes, unless another save to ``key`` is in flight."""
    with _lock:
        _claimed.discard(key)
    remove_if_empty(key)


def _unsettled(key: str, but: _Save | None = None) -> list[_Save]:
    """With the lock held: the saves to ``key`` not settled yet (``but`` left out)."""
    return [s for s in _in_flight.get(key, []) if not s.settled.is_set() and s is not but]


def _settled(key: str, save: _Save) -> None:
    """A save to ``key`` ended (any thread): if it failed, and no other save to ``key`` is in
    flight, what was made for it at ``save_checkpoint`` goes if it holds nothing. Readers
    waiting for the save go on only then."""
    try:
        if save.handle.future.exception() is not None and is_local(key):
            with _lock:
                if _unsettled(key, but=save):
                    return
                _failed.add(key)
            remove_if_empty(key, but=save)
    finally:
        save.settled.set()
        with _lock:
            if not _unsettled(key):
                _in_flight.pop(key, None)
                _rewatch()


def take_failed() -> set[str]:
    """The local paths whose latest save failed since the last call."""
    with _lock:
        failed = set(_failed)
        _failed.clear()
    return failed


def wait_for_checkpoint(path: str | os.PathLike[str], timeout: float | None = None) -> None:
    """Wait until no save to ``path`` made in this process (by any
    :class:`~aiosnap.integrations.lightning.AiosnapCheckpointIO`) is in flight, so that a
    plain ``torch.load(path)`` or ``LightningModule.load_from_checkpoint(path)`` reads what
    the last of them committed. A symlink is followed to its target. It does not report a
    save's failure (Lightning hears of it at the next ``save_checkpoint`` or at
    ``teardown``): a path whose first save failed holds no file afterwards. TimeoutError
    after ``timeout`` seconds."""
    key = key_of(path)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with _lock:
            saves = _unsettled(key)
        if not saves:
            return
        left = None if deadline is None else deadline - time.monotonic()
        if not saves[0].settled.wait(None if left is None else max(0.0, left)):
            raise TimeoutError(f"{shown_url(path)}: {len(saves)} save(s) to it still in flight after {timeout} s")


def make_placeholder(key: str) -> None:
    """Caller's thread, before a save to ``key`` starts (:func:`track` it, or call
    :func:`save_not_started`): a placeholder at ``key`` unless something is there already."""
    os.makedirs(os.path.dirname(key), exist_ok=True)
    data = placeholder_bytes(os.getpid())
    with _lock:
        _claimed.add(key)
        try:
            fd = os.open(key, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileExistsError:
            return
        try:
            os.write(fd, data)
            stat = os.fstat(fd)
        finally:
            os.close(fd)
        _placeholders[key] = (stat.st_dev, stat.st_ino, len(data))


def placeholder_at(key: str) -> str | None:
    """The message of the placeholder at the local path ``key`` (any process's), or None:
    something else, or nothing, is there. An empty file counts as one (older aiosnap put
    those)."""
    try:
        with open(key, "rb") as f:
            data = f.read(MAX_PLACEHOLDER_BYTES + 1)
    except OSError:
        return None
    if not data:
        return "aiosnap: this file is empty: a save to it never completed (older aiosnap's placeholder)"
    return placeholder_message(data)


def remove_if_empty(key: str, *, but: _Save | None = None) -> None:
    """Remove what was made for ``key`` if it still holds nothing: the placeholder made by
    :func:`make_placeholder` (the very same file, unchanged), or a tree of empty folders (a
    failed folder checkpoint's cleanup leaves those), so that ``ckpt_path="last"`` never
    picks an empty one. Never while a save to ``key`` (other than ``but``) is in flight."""
    with _lock:
        if _unsettled(key, but=but) or key in _claimed:
            return
        made = _placeholders.pop(key, None)
        if made is not None:
            with contextlib.suppress(OSError):
                stat = os.stat(key, follow_symlinks=False)
                if (stat.st_dev, stat.st_ino, stat.st_size) == made:
                    os.unlink(key)
            return
    for folder, _, _ in os.walk(key, topdown=False, followlinks=False):
        with contextlib.suppress(OSError):
            os.rmdir(folder)
