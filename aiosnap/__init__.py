"""aiosnap: asyncio checkpoint service for PyTorch training.

``save()`` returns once the state is captured; the checkpoint becomes durable and
committed in the background, within enforced RAM budgets. Importing the package is cheap
(no torch): the public names are imported on first use.
"""

from typing import TYPE_CHECKING, Any

from .errors import (
    AiosnapError,
    CheckpointerClosedError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    ChecksumMismatchError,
    ConfigError,
    CorruptCheckpointError,
    DistributedError,
    ForkedProcessError,
    ManifestError,
    PickleNotAllowedError,
    PlainReadTimeoutError,
    RankFailedError,
    RanksDisagreeError,
    RankTimeoutError,
    SpoolBusyError,
    StateMismatchError,
    StepOrderError,
    StorageError,
    StorageUnavailableError,
    TruncatedObjectError,
    UnsupportedCheckpointError,
    UnsupportedStateError,
    UploadProcessError,
    WrongThreadError,
)

if TYPE_CHECKING:  # the rest is imported on first use: `import aiosnap` does not import torch
    from .checkpointer import Checkpointer, SaveHandle, SaveResult, SyncCheckpointer, SyncSaveHandle
    from .config import Config, load_config
    from .core.events import Event, JsonlHandler, LoggingHandler
    from .core.progress import SaveProgress
    from .core.rng import RNGState
    from .distributed.stateful import ShardedState
    from .format.manifest import Manifest
    from .interop.exporting import export
    from .interop.safetensors.api import open_safetensors
    from .interop.safetensors.live import SafetensorsExport

_LAZY = {
    "Checkpointer": "checkpointer",
    "SaveHandle": "checkpointer",
    "SaveResult": "checkpointer",
    "SyncCheckpointer": "checkpointer",
    "SyncSaveHandle": "checkpointer",
    "Config": "config",
    "load_config": "config",
    "Event": "core.events",
    "JsonlHandler": "core.events",
    "LoggingHandler": "core.events",
    "Manifest": "format.manifest",
    "RNGState": "core.rng",
    "SaveProgress": "core.progress",
    "ShardedState": "distributed.stateful",
    "SafetensorsExport": "interop.safetensors.live",
    "export": "interop.exporting",
    "open_safetensors": "interop.safetensors.api",
}


def __getattr__(name: str) -> Any:
    if name == "dcp":  # the DCP storage layer: aiosnap.dcp.StorageWriter(...) after `import aiosnap`
        import importlib

        return importlib.import_module(".dcp", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aiosnap' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "AiosnapError",
    "CheckpointNotFoundError",
    "CheckpointReplacedError",
    "Checkpointer",
    "CheckpointerClosedError",
    "ChecksumMismatchError",
    "Config",
    "ConfigError",
    "CorruptCheckpointError",
    "DistributedError",
    "Event",
    "ForkedProcessError",
    "JsonlHandler",
    "LoggingHandler",
    "Manifest",
    "ManifestError",
    "PickleNotAllowedError",
    "PlainReadTimeoutError",
    "RNGState",
    "RankFailedError",
    "RankTimeoutError",
    "RanksDisagreeError",
    "SafetensorsExport",
    "SaveHandle",
    "SaveProgress",
    "SaveResult",
    "ShardedState",
    "SpoolBusyError",
    "StateMismatchError",
    "StepOrderError",
    "StorageError",
    "StorageUnavailableError",
    "SyncCheckpointer",
    "SyncSaveHandle",
    "TruncatedObjectError",
    "UnsupportedCheckpointError",
    "UnsupportedStateError",
    "UploadProcessError",
    "WrongThreadError",
    "export",
    "load_config",
    "open_safetensors",
]
