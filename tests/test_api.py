"""The public surface: curated, sorted, typed."""

from __future__ import annotations

from pathlib import Path

import aiosnap


def test_all_is_sorted_and_exported() -> None:
    assert aiosnap.__all__ == sorted(aiosnap.__all__)
    for name in aiosnap.__all__:
        assert hasattr(aiosnap, name), name


def test_public_names_are_locked() -> None:
    assert set(aiosnap.__all__) == {
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
    }


def test_every_error_derives_from_the_root() -> None:
    errors = [getattr(aiosnap, n) for n in aiosnap.__all__ if n.endswith("Error")]
    assert all(issubclass(e, aiosnap.AiosnapError) for e in errors)


def test_package_is_typed() -> None:
    assert (Path(aiosnap.__file__).parent / "py.typed").exists()
