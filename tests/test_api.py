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


def test_a_file_that_is_no_checkpoint_is_never_overwritten(tmp_path: Path) -> None:
    """A newcomer passed a YAML config's path where a root goes: the first save replaced the
    config with a single-file checkpoint. Now refused, naming the file, the file untouched."""
    import pytest
    import torch
    from aiosnap import ConfigError, SyncCheckpointer

    config_file = tmp_path / "job.yaml"
    config_file.write_text("ram_budget: 1GiB\n")
    with pytest.raises(ConfigError, match=r"job\.yaml is a file that is not a checkpoint.*load_config"):
        SyncCheckpointer(str(config_file))
    assert config_file.read_text() == "ram_budget: 1GiB\n"
    empty = tmp_path / "new.ckpt"
    empty.touch()  # an empty file (a path reserved for a checkpoint) is still one to write
    with SyncCheckpointer(str(empty)) as ckpt:
        ckpt.save({"w": torch.ones(2)}, step=1).wait()
    assert torch.equal(torch.load(empty, weights_only=True)["w"], torch.ones(2))


def test_the_dcp_layer_is_an_attribute_after_import_aiosnap() -> None:
    import aiosnap

    assert aiosnap.dcp.StorageWriter.__name__ == "StorageWriter"  # the README's one-line switch
