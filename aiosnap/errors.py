"""The aiosnap error tree.

Every error aiosnap raises on its own account derives from :class:`AiosnapError`::

    AiosnapError
    ├── ConfigError                  bad configuration (file, field, value)
    ├── CheckpointerClosedError      the checkpointer was used after close()
    ├── WrongThreadError             a blocking call was made from aiosnap's own loop thread
    ├── ForkedProcessError           a checkpointer was used in a child made by os.fork()
    ├── SpoolBusyError               another process holds the spool directory's lock
    ├── UnsupportedStateError        a value in the state cannot be saved
    ├── UnsupportedCheckpointError   a foreign checkpoint uses what aiosnap does not read
    ├── StepOrderError               a step older than the latest (or already being saved)
    ├── CheckpointNotFoundError      no committed checkpoint (or not the requested step)
    │   └── CheckpointReplacedError  a checkpoint being loaded was overwritten meanwhile
    ├── StateMismatchError           load(state): the checkpoint does not fit the given state
    ├── UploadProcessError           the upload process (upload.executor: process) died
    ├── DistributedError             a multi-rank save or load could not be coordinated
    │   ├── RanksDisagreeError       ranks saved different steps or differently shaped states
    │   ├── RankTimeoutError         ranks missing (named) when the timeout ran out
    │   └── RankFailedError          another rank's part of the save failed: nothing committed
    ├── StorageError                 a remote store refused or failed a request (botocore chained)
    │   └── StorageUnavailableError  retries (throttling, 5xx, resets, timeouts) ran out of time
    ├── CorruptCheckpointError       a checkpoint exists but must not be trusted
    │   ├── ManifestError            manifest missing fields, wrong version, unsafe object name
    │   ├── TruncatedObjectError     a data object is shorter than the manifest says
    │   └── ChecksumMismatchError    a byte range does not match its crc32c
    ├── PickleNotAllowedError        loading would unpickle and allow_pickle is False
    └── PlainReadTimeoutError        a plain read waiting for its thread's save ran out of time

Errors raised by storage while a save runs in the background (``OSError`` from a
disk, for instance) are *not* translated: they surface with their original type at
``await handle`` / ``handle.wait()``, at the next ``save()`` and at ``close()``.
"""

from __future__ import annotations

__all__ = [
    "AiosnapError",
    "CheckpointNotFoundError",
    "CheckpointReplacedError",
    "CheckpointerClosedError",
    "ChecksumMismatchError",
    "ConfigError",
    "CorruptCheckpointError",
    "DistributedError",
    "ForkedProcessError",
    "ManifestError",
    "PickleNotAllowedError",
    "PlainReadTimeoutError",
    "RankFailedError",
    "RankTimeoutError",
    "RanksDisagreeError",
    "SpoolBusyError",
    "StateMismatchError",
    "StepOrderError",
    "StorageError",
    "StorageUnavailableError",
    "TruncatedObjectError",
    "UnsupportedCheckpointError",
    "UnsupportedStateError",
    "UploadProcessError",
    "WrongThreadError",
]


class AiosnapError(Exception):
    """Root of every error aiosnap raises on its own account."""


class ConfigError(AiosnapError, ValueError):
    """Configuration is invalid; the message names the file and the field."""


class CheckpointerClosedError(AiosnapError, RuntimeError):
    """The checkpointer was used after ``close()``."""


class WrongThreadError(AiosnapError, RuntimeError):
    """A blocking call was made from aiosnap's own event-loop thread (it would deadlock)."""


class ForkedProcessError(AiosnapError, RuntimeError):
    """A checkpointer made before ``os.fork()`` was used in the child, where its background
    thread does not exist; make a new checkpointer in the child."""


class SpoolBusyError(AiosnapError, RuntimeError):
    """Another process (or checkpointer) holds the lock of the spool directory."""


class UnsupportedStateError(AiosnapError, TypeError):
    """A value in the state cannot be saved (sparse or meta tensors, for example)."""


class UnsupportedCheckpointError(AiosnapError, ValueError):
    """A checkpoint of another format (DCP, ``torch.save``) uses something aiosnap does not
    read (a tensor stored as a strided view, DCP stream transforms, ...); the message names
    the item and the way out. The checkpoint itself may well be intact."""


class StepOrderError(AiosnapError, ValueError):
    """``save()`` of a step older than the root's latest committed step, or of a step this
    checkpointer is already saving: steps only move forward (see ``rollback()``)."""


class CheckpointNotFoundError(AiosnapError, LookupError):
    """There is no committed checkpoint, or not the requested step."""


class CheckpointReplacedError(CheckpointNotFoundError):
    """The checkpoint being loaded was replaced meanwhile (an overwrite committed and removed
    the files the version being read named): nothing is wrong with either; load again."""


class StateMismatchError(AiosnapError, ValueError):
    """``load(state)``: a key of ``state`` is not in the checkpoint, or a tensor's shape or a
    value's kind differs; the message names the path."""


class UploadProcessError(AiosnapError, RuntimeError):
    """The upload process (``upload.executor: process``) died or stopped answering: the saves
    it had are failed (their spooled chunks stay for resume); the next save starts a new one."""


class DistributedError(AiosnapError, RuntimeError):
    """A multi-rank save or load could not be coordinated; no step was committed by it."""


class RanksDisagreeError(DistributedError, ValueError):
    """Ranks called ``save()``/``load()`` for different steps, or with states whose replicated
    entries differ (paths, dtypes, shapes, placements); the message names the first difference."""


class RankTimeoutError(DistributedError, TimeoutError):
    """Ranks did not arrive (at ``save()``'s agreement) or did not deliver their part of a save
    (at its commit) within the timeout; the message names them."""


class RankFailedError(DistributedError):
    """Another rank's part of the save failed or the coordinator gave the save up; the
    message carries the reason it recorded. Nothing was committed."""


class StorageError(AiosnapError):
    """A remote store refused or failed a request; the backend's error is chained."""


class StorageUnavailableError(StorageError):
    """A request kept failing with retryable errors until its retry deadline passed."""


class CorruptCheckpointError(AiosnapError):
    """A checkpoint's manifest or data is damaged; it is refused rather than loaded."""


class ManifestError(CorruptCheckpointError):
    """The manifest is unreadable, of an unknown version, or names an unsafe object."""


class TruncatedObjectError(CorruptCheckpointError):
    """A data object is shorter than the byte ranges the manifest gives for it."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A byte range read back does not match the crc32c recorded in the manifest."""


class PickleNotAllowedError(AiosnapError):
    """The checkpoint holds pickled objects and the caller did not pass ``allow_pickle=True``."""


class PlainReadTimeoutError(AiosnapError, TimeoutError):
    """A plain read (``torch.load``, ``open``) of a Lightning checkpoint path by the thread that
    saved it waited for that save longer than the plugin's ``plain_reads_timeout``; the
    message names the path."""


def first_error(error: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first leaf of an exception group (from a TaskGroup), so that it can be re-raised
    with its original type: ``raise (leaf := first_error(g)) from leaf.__cause__`` keeps the
    leaf's own cause."""
    leaf: BaseException = error
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf
