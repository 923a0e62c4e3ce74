"""Lightning ``CheckpointIO`` plugin: ``Trainer(plugins=[AiosnapCheckpointIO(config)])``.

Each local checkpoint path Lightning names (``.../epoch=1-step=20.ckpt``, ``last.ckpt``) is
one file in the zip format of ``torch.save`` (:class:`~aiosnap.interop.singlefile.ArchiveStorage`):
``torch.load``, ``LightningModule.load_from_checkpoint``, ``Trainer(ckpt_path=...)`` without
the plugin, the loggers' ``log_model`` and ``os.path.isfile`` checks all work on it, and it
carries aiosnap's manifest (a crc32c per tensor) for the plugin's verified loads. Writing a
path again replaces the file atomically once the new version is complete. An
``s3://bucket/...`` URL is an aiosnap checkpoint root (a prefix of data objects and a
manifest). A folder saved by an older aiosnap at a local path is still read, and written, as
a folder. All paths share one background thread, one RAM budget and one set of staging
slabs (from ``config``).

Threads: every method runs on the caller's (the trainer's) thread; saves continue on
aiosnap's loop thread, removals on a small helper thread of this plugin.

- ``save_checkpoint`` returns once the state is captured into host RAM (no clone of the
  model on the GPU); durability follows in the background. A local path exists when it
  returns (an empty file until the first version is committed; an older version until the
  new one is), so Lightning's version counter and ``save_last="link"`` see it.
- ``load_checkpoint`` first waits for saves in flight to that path (made by any plugin in
  this process; a symlink is followed to its target).
- ``remove_checkpoint`` of a symlink (``save_last="link"``) unlinks the link at once and
  never touches its target. Of a checkpoint, it never blocks training and never races a
  save: it waits (on the
  helper thread) for every save in flight when it was called and for the latest save, and
  removes the path only if all of them committed -- the last committed checkpoint is never
  deleted while a newer one is still pending or has failed. A new save to the same path
  supersedes the removal; only a save to that same path waits while it is deleted.
- ``teardown`` waits for everything and re-raises a background failure with its original
  type, unless Lightning was already told about it (by a later ``save_checkpoint``).
- The plugin pickles (``torch.save(trainer)``, ``copy.deepcopy``, ``strategy="ddp_spawn"``):
  a copy is a fresh plugin with the same settings; saves in flight stay with the original.
- Saves accepted before the process exits normally are finished at exit (see *Lifecycle* in
  ``docs/concepts/captured-and-durable.md``), also when Lightning never calls ``teardown`` again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

try:
    from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
    from lightning_utilities.core.apply_func import apply_to_collection
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("aiosnap.integrations.lightning needs Lightning: pip install 'aiosnap[lightning]'") from exc

from ..checkpointer import ConfigLike, SyncCheckpointer, SyncSaveHandle
from ..config import Config
from ..core.events import EventHandler
from ..errors import CheckpointNotFoundError
from ..interop.singlefile import ArchiveStorage, is_archive
from ..storage.base import Storage
from ..storage.registry import storage_from_url

__all__ = ["AiosnapCheckpointIO", "checkpoint_storage"]

log = logging.getLogger("aiosnap")

_in_flight_lock = threading.Lock()
_in_flight: dict[str, list[SyncSaveHandle]] = {}
"""Saves in flight in this process, by path, whichever plugin made them: a reader of a path
waits for them (another plugin instance, ``Trainer(ckpt_path=...)``)."""


def _track(key: str, handle: SyncSaveHandle) -> None:
    with _in_flight_lock:
        handles = [h for h in _in_flight.get(key, []) if not h.done()]
        _in_flight[key] = [*handles, handle]
    handle.future.add_done_callback(lambda future: _settled(key, future))


_failed_keys: set[str] = set()
"""Local paths whose latest save failed: what was made for them goes at teardown if empty."""
_placeholders: dict[str, tuple[int, int]] = {}
"""Empty files this process put at paths so that they exist while their first save is in
flight: path -> (st_dev, st_ino)."""


def _settled(key: str, future: concurrent.futures.Future[Any]) -> None:
    """A save to ``key`` ended (any thread): forget it; if it failed, what was made for it
    at ``save_checkpoint`` goes again if it holds nothing (see :func:`_remove_if_empty`)."""
    if _saves_in_flight(key) or future.exception() is None or not _is_local(key):
        return
    with _in_flight_lock:
        _failed_keys.add(key)
    _remove_if_empty(key)


def _make_placeholder(key: str) -> None:
    """Caller's thread: an empty file at ``key`` unless something is there already."""
    os.makedirs(os.path.dirname(key), exist_ok=True)
    try:
        fd = os.open(key, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return
    try:
        stat = os.fstat(fd)
    finally:
        os.close(fd)
    with _in_flight_lock:
        _placeholders[key] = (stat.st_dev, stat.st_ino)


def _remove_if_empty(key: str) -> None:
    """Remove what was made for ``key`` if it still holds nothing: the empty file made by
    :func:`_make_placeholder` (the very same file), or a tree of empty folders (a failed
    folder checkpoint's cleanup leaves those), so that ``ckpt_path="last"`` never picks an
    empty one. Never while a save to ``key`` is in flight."""
    if _saves_in_flight(key):
        return
    with _in_flight_lock:
        made = _placeholders.pop(key, None)
    if made is not None:
        with contextlib.suppress(OSError):
            stat = os.stat(key, follow_symlinks=False)
            if (stat.st_dev, stat.st_ino) == made and stat.st_size == 0:
                os.unlink(key)
        return
    for folder, _, _ in os.walk(key, topdown=False, followlinks=False):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def _saves_in_flight(key: str) -> list[SyncSaveHandle]:
    with _in_flight_lock:
        handles = [h for h in _in_flight.get(key, []) if not h.done()]
        if handles:
            _in_flight[key] = handles
        else:
            _in_flight.pop(key, None)
        return handles


def _is_local(key: str) -> bool:
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
    return os.path.realpath(where) if _is_local(where) else where


def checkpoint_storage(url: str, config: Config) -> Storage:
    """The plugin's default backend for one checkpoint path: a local path is one file
    (:class:`ArchiveStorage`), unless it is a folder an older aiosnap saved (then a folder
    root, as before); a URL is the root its scheme names (``s3://``)."""
    if _is_local(url) and not os.path.isdir(url):
        return ArchiveStorage(url)
    return storage_from_url(url, config)


class AiosnapCheckpointIO(CheckpointIO):
    """Lightning checkpoints through aiosnap (see the module docstring for the rules).

    ``config``: an aiosnap :class:`~aiosnap.Config` (or dict / YAML-loaded config); its
    RAM budget, upload, S3 and event settings apply; ``storage.url`` is not used (paths
    come from Lightning). ``allow_pickle``: load checkpoints holding pickled objects (such
    as non-JSON hyper-parameters); off by default because unpickling runs code.
    ``event_handlers``: callables receiving every event. ``storage_for(url, config)``: the
    backend for one checkpoint path (custom or wrapped backends; default
    :func:`checkpoint_storage`).
    """

    def __init__(
        self,
        config: ConfigLike = None,
        *,
        allow_pickle: bool = False,
        event_handlers: Sequence[EventHandler] = (),
        storage_for: Callable[[str, Config], Storage] = checkpoint_storage,
    ) -> None:
        super().__init__()
        self.storage_for = storage_for
        self.config = Config.coerce(config)
        self.allow_pickle = allow_pickle
        self.event_handlers = list(event_handlers)
        self._fresh()

    def _fresh(self) -> None:
        """The plugin's own state: nothing opened, nothing in flight."""
        self._lock = threading.RLock()  # guards the tables below; never held while deleting
        self._key_locks: dict[str, threading.Lock] = {}  # a path's save and removal, one at a time
        self._checkpointer: SyncCheckpointer | None = None
        self._locations: dict[str, SyncCheckpointer] = {}
        self._single_file: dict[str, bool] = {}  # whose storage is one file
        self._next_step: dict[str, int] = {}
        self._generation: dict[str, int] = {}
        self._pending: dict[str, list[SyncSaveHandle]] = {}
        self._last_save: SyncSaveHandle | None = None
        self._removals: list[concurrent.futures.Future[None]] = []
        self._remover: concurrent.futures.ThreadPoolExecutor | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Its settings only (the checkpointer, locks and saves in flight stay here)."""
        return {
            "config": self.config,
            "allow_pickle": self.allow_pickle,
            "event_handlers": self.event_handlers,
            "storage_for": self.storage_for,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh()

    # -- plumbing ---------------------------------------------------------------------

    def _root(self) -> SyncCheckpointer:
        if self._checkpointer is None:
            # Lightning's CheckpointIO: one process writes each file (global rank 0), every rank
            # may read it; so aiosnap acts as a job of one rank here, whatever the job's size
            self._checkpointer = SyncCheckpointer(self.config, rank=0, world_size=1, event_handlers=self.event_handlers)
            self._checkpointer._closed_at_exit_by_its_owner()  # Lightning may never call teardown
        return self._checkpointer

    def _location(self, key: str) -> SyncCheckpointer:
        view = self._locations.get(key)
        if view is None:
            storage = self.storage_for(key, self.config)
            self._single_file[key] = storage.single_file
            view = self._locations[key] = self._root().at(key, keep_last=1, storage=storage)
            if self.config.spool.effective_mode != "off" and self.config.spool.resume:
                view.resume_spool()  # a save to this path that a crash left in the spool
        return view

    def _handles(self, key: str) -> list[SyncSaveHandle]:
        handles = [h for h in self._pending.get(key, []) if not h.done()]
        self._pending[key] = handles
        return handles

    def _all_pending(self) -> list[SyncSaveHandle]:
        return [h for key in list(self._pending) for h in self._handles(key)]

    def _key_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._key_locks.setdefault(key, threading.Lock())

    # -- CheckpointIO -----------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Capture ``checkpoint`` for ``path`` and return; it commits in the background."""
        if storage_options is not None:
            raise TypeError(
                "AiosnapCheckpointIO.save_checkpoint does not take storage_options; "
                "configure storage through the aiosnap config instead"
            )
        key = key_of(path)  # a save through a link goes to its target
        with self._key_lock(key), self._lock:
            self._generation[key] = self._generation.get(key, 0) + 1  # supersedes a pending removal
            location = self._location(key)
            if _is_local(key):  # the path exists when save_checkpoint returns
                if self._single_file.get(key, False):
                    _make_placeholder(key)
                else:
                    os.makedirs(key, exist_ok=True)
            step = self._next_step.get(key)
            if step is None:
                committed = location.steps()
                step = committed[-1] + 1 if committed else 1
            metadata = {
                "lightning": {
                    "global_step": int(checkpoint.get("global_step", 0)),
                    "epoch": int(checkpoint.get("epoch", 0)),
                    "path": os.fspath(path),
                }
            }
            handle = location.save(checkpoint, step=step, metadata=metadata)
            self._next_step[key] = step + 1
            self._pending.setdefault(key, []).append(handle)
            self._last_save = handle
            _track(key, handle)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint at ``path`` (waiting for saves to it in flight), checking every
        tensor's crc32c. A file ``torch.save`` wrote (not by aiosnap) is read with Lightning's
        own loader, for migrating."""
        key = key_of(path)  # a symlinked ``last`` reads (and waits for) its target
        with self._lock:
            handles = self._handles(key)
        concurrent.futures.wait([h.future for h in [*handles, *_saves_in_flight(key)]])
        if _is_local(key) and os.path.isfile(key) and not is_archive(key):
            if os.path.getsize(key) == 0:  # the placeholder of a first save that never finished
                raise FileNotFoundError(
                    f"Checkpoint file not found: {path} is empty: a save to it never completed (the process "
                    "that made it stopped before its first version was committed)"
                )
            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        with self._lock:
            location = self._location(key)
        try:
            state = location.load(allow_pickle=self.allow_pickle and weights_only is not True)
        except CheckpointNotFoundError as exc:
            raise FileNotFoundError(f"Checkpoint file not found: {path} ({exc})") from exc
        if isinstance(map_location, (str, torch.device)):
            device = torch.device(map_location)
            state = apply_to_collection(state, torch.Tensor, lambda tensor: tensor.to(device))
        if not isinstance(state, dict):
            raise TypeError(f"{path}: holds a {type(state).__name__}, not a Lightning checkpoint dict")
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Schedule removal of ``path`` once every save now in flight, and the latest save,
        have committed."""
        where = location_of(path)
        if _is_local(where) and os.path.islink(where):
            os.unlink(where)  # a link is not a checkpoint: never delete through it
            return
        key = key_of(where)
        with self._lock:
            waiting_for = [h.future for h in self._all_pending()]
            if self._last_save is not None:  # it may have failed already: then keep ``path``
                waiting_for.append(self._last_save.future)
            generation = self._generation.get(key, 0)
            if self._remover is None:
                self._remover = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aiosnap-remover")
            self._removals.append(self._remover.submit(self._remove, key, where, generation, waiting_for))

    def _remove(self, key: str, where: str, generation: int, waiting_for: list[concurrent.futures.Future[Any]]) -> None:
        """Helper thread: wait, then delete ``key`` unless a newer save failed or reused it.
        Only a save to the same path waits for the deletion; other saves go on."""
        concurrent.futures.wait(waiting_for)
        failed = [f.exception() for f in waiting_for if f.exception() is not None]
        if failed:
            log.warning(
                "aiosnap: keeping %s: a newer save failed (%r), so it may be the last good checkpoint", key, failed[0]
            )
            return
        with self._key_lock(key):
            with self._lock:
                if self._generation.get(key, 0) != generation:
                    return  # saved again since: the new version replaced the old one already
                if _is_local(where) and os.path.islink(where):  # linked since: not ours to follow
                    log.warning("aiosnap: not removing %s: it is a symbolic link now", where)
                    return
                if _is_local(key) and Path(key).is_file() and not is_archive(key):  # torch.save's, or empty
                    Path(key).unlink()
                    return
                location = self._location(key)
                del self._locations[key]
                self._next_step.pop(key, None)
                self._pending.pop(key, None)
            try:
                location.purge()
            finally:
                location.close()

    def teardown(self) -> None:
        """Wait for removals and saves; re-raise a failure Lightning has not seen yet. The
        plugin can be used again afterwards (a new fit starts fresh)."""
        with self._lock:
            removals, self._removals = self._removals, []
            remover, self._remover = self._remover, None
        try:
            for removal in removals:
                removal.result()  # a removal that failed raises here, with its type
        finally:
            if remover is not None:
                remover.shutdown(wait=True)
            with self._lock:
                checkpointer, self._checkpointer = self._checkpointer, None
                self._locations.clear()
                self._next_step.clear()
                self._pending.clear()
                self._last_save = None
            try:
                if checkpointer is not None:
                    checkpointer.close()  # raises a failure Lightning has not been told about, once
            finally:
                with _in_flight_lock:
                    failed = set(_failed_keys)
                    _failed_keys.clear()
                for key in failed:  # their failed attempts are cleaned up by now
                    _remove_if_empty(key)
