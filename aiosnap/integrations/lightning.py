"""Lightning ``CheckpointIO`` plugin: ``Trainer(plugins=[AiosnapCheckpointIO(config)])``.

Each local checkpoint path Lightning names (``.../epoch=1-step=20.ckpt``, ``last.ckpt``) is
one file in the zip format of ``torch.save`` (:class:`~aiosnap.interop.singlefile.ArchiveStorage`):
``torch.load``, ``LightningModule.load_from_checkpoint``, ``Trainer(ckpt_path=...)`` without
the plugin, the loggers' ``log_model`` and ``os.path.isfile`` checks all work on it, and it
carries aiosnap's manifest (a crc32c per tensor) for the plugin's verified loads. Writing a
path again replaces the file atomically once the new version is complete; while a save runs,
its bytes are in a partial file that listings of the folder do not show
(:mod:`aiosnap.interop.partialfile`). An ``s3://bucket/...`` URL is an aiosnap checkpoint
root (a prefix of data objects and a manifest); any other URL (``http(s)://``, ``memory://``,
...) is fsspec's, as with Lightning's own CheckpointIO (:mod:`.fetch`). A folder saved by an
older aiosnap at a local path is still read, and written, as a folder. All paths share one
background thread, one RAM budget and one set of staging slabs (from ``config``).

Threads: every method runs on the caller's (the trainer's) thread; saves continue on
aiosnap's loop thread, removals on a small helper thread of this plugin.

- ``save_checkpoint`` returns once the state is captured into host RAM (no clone of the
  model on the GPU); durability follows in the background. A local path exists when it
  returns (a placeholder until the first version is committed, which ``torch.load`` refuses
  with a message saying so: :mod:`.inflight`; an older version until the new one is), so
  Lightning's version counter and ``save_last="link"`` see it.
- ``load_checkpoint`` first waits for saves in flight to that path (made by any plugin in
  this process; a symlink is followed to its target), as :func:`wait_for_checkpoint` does
  for any other reader. A plain read of the path (``torch.load``) by the thread that saved
  it waits too with ``plain_reads_wait=True`` (:mod:`.plainreads`; up to
  ``plain_reads_timeout`` seconds); by default it does not wait.
- ``remove_checkpoint`` of a symlink (``save_last="link"``) unlinks the link at once and
  never touches its target. Of a checkpoint, it never blocks training and never races a
  save: it waits (on the
  helper thread) for every save in flight when it was called and for the latest save, and
  removes the path only if all of them committed -- the last committed checkpoint is never
  deleted while a newer one is still pending or has failed. A new save to the same path
  supersedes the removal; only a save to that same path waits while it is deleted.
- ``teardown`` waits for everything and re-raises a background failure with its original
  type, unless Lightning was already told about it (by a later ``save_checkpoint``).
- Values only pickle can store (hyper-parameters, loop and callback states) are saved
  pickled, as ``torch.save`` does; loading them needs ``allow_pickle=True``.
- The plugin pickles (``torch.save(trainer)``, ``copy.deepcopy``, ``strategy="ddp_spawn"``):
  a copy is a fresh plugin with the same settings; saves in flight stay with the original.
- Saves accepted before the process exits normally are finished at exit (see *Lifecycle* in
  ``docs/concepts/captured-and-durable.md``), also when Lightning never calls ``teardown`` again.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
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
from ..errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from ..interop.singlefile import ArchiveStorage, is_archive, is_damaged_archive
from ..storage.base import Storage
from ..storage.registry import storage_from_url
from . import plainreads
from .fetch import fetched, scrubbed, shown, through_fsspec, unreadable_download_named
from .inflight import (
    is_local,
    key_of,
    location_of,
    make_placeholder,
    placeholder_at,
    remove_if_empty,
    save_not_started,
    take_failed,
    track,
    wait_for_checkpoint,
)

__all__ = ["AiosnapCheckpointIO", "checkpoint_storage", "wait_for_checkpoint"]

log = logging.getLogger("aiosnap")


def _checkpoint_dict(state: Any, path: Any) -> dict[str, Any]:
    """``state`` if it is a Lightning checkpoint (a dict); TypeError naming ``path`` else,
    whichever format held it (``torch.save`` of a list, an aiosnap save of a tensor)."""
    if not isinstance(state, dict):
        raise TypeError(f"{shown(path)}: holds a {type(state).__name__}, not a Lightning checkpoint dict")
    return state


def checkpoint_storage(url: str, config: Config) -> Storage:
    """The plugin's default backend for one checkpoint path: a local path is one file
    (:class:`ArchiveStorage`), unless it is a folder an older aiosnap saved (then a folder
    root, as before); a URL is the root its scheme names (``s3://``)."""
    if is_local(url) and not os.path.isdir(url):
        return ArchiveStorage.for_config(url, config)
    return storage_from_url(url, config)


class AiosnapCheckpointIO(CheckpointIO):
    """Lightning checkpoints through aiosnap (see the module docstring for the rules).

    ``config``: an aiosnap :class:`~aiosnap.Config` (or dict / YAML-loaded config); its
    RAM budget, upload, S3 and event settings apply; ``storage.url`` is not used (paths
    come from Lightning). ``allow_pickle``: load checkpoints holding pickled objects (such
    as non-JSON hyper-parameters); off by default because unpickling runs code.
    ``event_handlers``: callables receiving every event. ``storage_for(url, config)``: the
    backend for one checkpoint path (custom or wrapped backends; default
    :func:`checkpoint_storage`). ``plain_reads_wait`` (off by default): a plain read of a
    local checkpoint path (``torch.load``, ``open``) by the thread that saved it waits for the
    save in flight (:mod:`.plainreads`), logging a warning once per save it waits for, and
    raises :class:`~aiosnap.errors.PlainReadTimeoutError` naming the path after
    ``plain_reads_timeout`` seconds; off, such a read gets the previous version, or during a
    first save an error saying that the save is still running.
    """

    def __init__(
        self,
        config: ConfigLike = None,
        *,
        allow_pickle: bool = False,
        event_handlers: Sequence[EventHandler] = (),
        storage_for: Callable[[str, Config], Storage] = checkpoint_storage,
        plain_reads_wait: bool = False,
        plain_reads_timeout: float = 300.0,
    ) -> None:
        super().__init__()
        if not (isinstance(plain_reads_timeout, int | float) and 0 < plain_reads_timeout < math.inf):
            raise ConfigError(f"plain_reads_timeout: {plain_reads_timeout!r} is not a positive number of seconds")
        self.storage_for = storage_for
        self.plain_reads_wait = plain_reads_wait
        self.plain_reads_timeout = float(plain_reads_timeout)
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
            "plain_reads_wait": self.plain_reads_wait,
            "plain_reads_timeout": self.plain_reads_timeout,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh()

    # -- plumbing ---------------------------------------------------------------------

    def _root(self) -> SyncCheckpointer:
        if self._checkpointer is None:
            # Lightning's CheckpointIO: one process writes each file (global rank 0), every rank
            # may read it; so aiosnap acts as a job of one rank here, whatever the job's size
            # Lightning checkpoints hold values only pickle stores (hyper-parameters, loop and
            # callback states), as with torch.save: this plugin saves them (loading them is
            # still the caller's choice: allow_pickle)
            saving = self.config.model_copy(update={"pickle_values": True})
            self._checkpointer = SyncCheckpointer(saving, rank=0, world_size=1, event_handlers=self.event_handlers)
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
        """Capture ``checkpoint`` for ``path`` and return; it commits in the background. A URL
        aiosnap does not store (``memory://``, ``gs://``: see :mod:`.fetch`) is saved by
        Lightning's own writer, through fsspec, before this returns."""
        key = key_of(path)  # a save through a link goes to its target
        if through_fsspec(key):
            with self._key_lock(key), self._lock:
                self._generation[key] = self._generation.get(key, 0) + 1
            log.info("aiosnap: %s is saved by Lightning's own writer (fsspec), not by aiosnap", shown(key))
            TorchCheckpointIO().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(
                "AiosnapCheckpointIO.save_checkpoint does not take storage_options; "
                "configure storage through the aiosnap config instead"
            )
        with self._key_lock(key), self._lock:
            self._generation[key] = self._generation.get(key, 0) + 1  # supersedes a pending removal
            location = self._location(key)
            if is_local(key):  # the path exists when save_checkpoint returns
                if self._single_file.get(key, False):
                    make_placeholder(key)
                else:
                    os.makedirs(key, exist_ok=True)
            try:
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
            except BaseException:
                if is_local(key):
                    save_not_started(key)  # refused on this thread: nothing of it stays at the path
                raise
            self._next_step[key] = step + 1
            self._pending.setdefault(key, []).append(handle)
            self._last_save = handle
            reads_wait = self.plain_reads_wait and is_local(key)
            if reads_wait:
                plainreads.install()
            track(key, handle, read_timeout=self.plain_reads_timeout if reads_wait else None)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint at ``path`` (waiting for saves to it in flight), checking every
        tensor's crc32c. A file ``torch.save`` wrote (not by aiosnap) is read with Lightning's
        own loader, for migrating; its pickled objects only with ``allow_pickle`` (or
        ``weights_only=False``). A URL aiosnap does not store (``http(s)://``, ...) is copied
        to a temporary file through fsspec first, then read the same way."""
        key = key_of(path)  # a symlinked ``last`` reads (and waits for) its target
        if through_fsspec(key):
            with fetched(key) as local:
                return unreadable_download_named(
                    key, lambda: self._load_file(str(local), path, map_location, weights_only)
                )
        with self._lock:
            handles = self._handles(key)
        concurrent.futures.wait([h.future for h in handles])
        wait_for_checkpoint(key)  # every plugin's saves to it, and the clean-up after a failed one
        if is_local(key) and os.path.isfile(key) and not is_archive(key):
            return self._load_file(key, path, map_location, weights_only)
        with self._lock:
            location = self._location(key)
        return self._loaded(location, path, map_location, weights_only)

    def _load_file(self, file: str, path: Any, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
        """A local file that is no aiosnap root of this plugin: an aiosnap single file
        (verified, through a view closed afterwards), a placeholder (FileNotFoundError:
        nothing committed there yet), an aiosnap file whose end is damaged
        (CorruptCheckpointError), or a file for ``torch.load``."""
        if is_archive(file):
            view = self._root().at(file, keep_last=1, storage=ArchiveStorage(file))
            try:
                return self._loaded(view, path, map_location, weights_only)
            finally:
                view.close()
        waiting = placeholder_at(file)
        if waiting is not None:
            raise FileNotFoundError(f"Checkpoint file not found: {shown(path)} holds no checkpoint. {waiting}")
        if is_damaged_archive(file):
            raise CorruptCheckpointError(
                f"{shown(path)}: an aiosnap checkpoint whose end (the zip end record and aiosnap's trailer) is "
                "damaged: not loaded, as torch.load would read it without checking a byte"
            )
        if weights_only is None:
            weights_only = not self.allow_pickle
        state = TorchCheckpointIO().load_checkpoint(file, map_location=map_location, weights_only=weights_only)
        return _checkpoint_dict(state, path)

    def _loaded(
        self, location: SyncCheckpointer, path: Any, map_location: Any, weights_only: bool | None
    ) -> dict[str, Any]:
        try:
            state = location.load(allow_pickle=self.allow_pickle and weights_only is not True)
        except CheckpointNotFoundError as exc:
            raise FileNotFoundError(f"Checkpoint file not found: {shown(path)} ({scrubbed(str(exc), path)})") from exc
        if isinstance(map_location, (str, torch.device)):
            device = torch.device(map_location)
            state = apply_to_collection(state, torch.Tensor, lambda tensor: tensor.to(device))
        return _checkpoint_dict(state, path)

    def remove_checkpoint(self, path: Any) -> None:
        """Schedule removal of ``path`` once every save now in flight, and the latest save,
        have committed."""
        where = location_of(path)
        if is_local(where) and os.path.islink(where):
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
                "aiosnap: keeping %s: a newer save failed (%s), so it may be the last good checkpoint",
                shown(key),
                scrubbed(repr(failed[0]), key),
            )
            return
        with self._key_lock(key):
            with self._lock:
                if self._generation.get(key, 0) != generation:
                    return  # saved again since: the new version replaced the old one already
                if is_local(where) and os.path.islink(where):  # linked since: not ours to follow
                    log.warning("aiosnap: not removing %s: it is a symbolic link now", where)
                    return
                if is_local(key) and Path(key).is_file() and not is_archive(key):  # torch.save's, or a placeholder
                    Path(key).unlink()
                    return
                if through_fsspec(key):  # saved by Lightning's writer
                    TorchCheckpointIO().remove_checkpoint(key)
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
                for key in take_failed():  # their failed attempts are cleaned up by now
                    remove_if_empty(key)
