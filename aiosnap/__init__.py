"""aiosnap: asyncio checkpoint service for PyTorch training.

``save()`` returns once the state is captured; the checkpoint becomes durable and
committed in the background, within enforced RAM budgets.
"""

from .checkpointer import Checkpointer, SaveHandle, SaveResult, SyncCheckpointer, SyncSaveHandle
from .config import Config, load_config
from .errors import (
    AiosnapError,
    CheckpointerClosedError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ConfigError,
    CorruptCheckpointError,
    ForkedProcessError,
    ManifestError,
    PickleNotAllowedError,
    SpoolBusyError,
    StateMismatchError,
    StepOrderError,
    StorageError,
    StorageUnavailableError,
    TruncatedObjectError,
    UnsupportedStateError,
    WrongThreadError,
)
from .events import Event, JsonlHandler, LoggingHandler
from .format.manifest import Manifest
from .rng import RNGState

__version__ = "0.1.0"

__all__ = [
    "AiosnapError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "CheckpointerClosedError",
    "ChecksumMismatchError",
    "Config",
    "ConfigError",
    "CorruptCheckpointError",
    "Event",
    "ForkedProcessError",
    "JsonlHandler",
    "LoggingHandler",
    "Manifest",
    "ManifestError",
    "PickleNotAllowedError",
    "RNGState",
    "SaveHandle",
    "SaveResult",
    "SpoolBusyError",
    "StateMismatchError",
    "StepOrderError",
    "StorageError",
    "StorageUnavailableError",
    "SyncCheckpointer",
    "SyncSaveHandle",
    "TruncatedObjectError",
    "UnsupportedStateError",
    "WrongThreadError",
    "load_config",
]
