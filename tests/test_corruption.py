"""Damaged or hostile checkpoints are refused with clear errors, never loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from aiosnap import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    Config,
    CorruptCheckpointError,
    ManifestError,
    PickleNotAllowedError,
    SyncCheckpointer,
    TruncatedObjectError,
)
from tests.fuzzing import sign_manifest


class Opaque:
    """A user object that only pickle can store."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.value == self.value


def _save(config: Config, state: dict[str, object], step: int = 1) -> None:
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(state, step=step).wait()


def _manifest_path(root: Path, step: int = 1) -> Path:
    return root / f"{step:012d}" / "manifest.json"


def _first_object(root: Path) -> Path:
    return next(p for p in sorted(root.rglob("*.bin")))


def test_missing_manifest_means_no_checkpoint(small_config: Config, root: Path) -> None:
    _save(small_config, {"x": torch.randn(10)})
    _manifest_path(root).unlink()
    with SyncCheckpointer(small_config) as ckpt:
        assert ckpt.steps() == []
        with pytest.raises(CheckpointNotFoundError):
            ckpt.load()
        with pytest.raises(CheckpointNotFoundError, match="step 1"):
            ckpt.load(step=1)


def test_truncated_data_object_is_refused(small_config: Config, root: Path) -> None:
    _save(small_config, {"x": torch.randn(1000)})
    obj = _first_object(root)
    obj.write_bytes(obj.read_bytes()[:100])
    with SyncCheckpointer(small_config) as ckpt, pytest.raises(TruncatedObjectError, match="truncated"):
        ckpt.load()


def test_missing_data_object_is_refused(small_config: Config, root: Path) -> None:
    _save(small_config, {"x": torch.randn(1000)})
    _first_object(root).unlink()
    with SyncCheckpointer(small_config) as ckpt, pytest.raises(CorruptCheckpointError, match="missing"):
        ckpt.load()


def test_flipped_byte_fails_checksum_and_an_atomic_load_leaves_state_untouched(
    small_config: Config, root: Path
) -> None:
    _save(small_config, {"x": torch.randn(1000)})
    obj = _first_object(root)
    data = bytearray(obj.read_bytes())
    data[1234] ^= 0x01
    obj.write_bytes(bytes(data))
    target = torch.zeros(1000)
    with SyncCheckpointer(small_config) as ckpt:
        with pytest.raises(ChecksumMismatchError, match="'x'"):
            ckpt.load({"x": target}, atomic=True)
        assert torch.count_nonzero(target) == 0, "an atomic load writes nothing into the caller's tensors"
        with pytest.raises(ChecksumMismatchError, match="in place: 'x' may now hold partly loaded data"):
            ckpt.load({"x": target})  # the default reads in place, and says what it touched


def test_pickled_objects_need_opt_in(small_config: Config) -> None:
    small_config = small_config.model_copy(update={"pickle_values": True})  # saving them is opted in too
    _save(small_config, {"obj": Opaque(5), "x": torch.ones(2)})
    with SyncCheckpointer(small_config) as ckpt:
        with pytest.raises(PickleNotAllowedError, match="'obj'"):
            ckpt.load()
        assert ckpt.load(allow_pickle=True)["obj"] == Opaque(5)


def test_tensors_and_plain_values_never_need_pickle(small_config: Config) -> None:
    _save(small_config, {"x": torch.ones(2), "meta": {"a": [1, 2.5, "s", None, (1, 2)]}})
    with SyncCheckpointer(small_config) as ckpt:
        assert ckpt.load()["meta"]["a"][4] == (1, 2)
        assert all(e.kind == "tensor" for e in ckpt.manifest().entries)


@pytest.mark.parametrize("evil", ["../outside.bin", "/etc/passwd", "000000000001/../../x.bin", "a\\..\\b", "c:/x"])
def test_object_names_escaping_the_root_are_refused(small_config: Config, root: Path, evil: str) -> None:
    _save(small_config, {"x": torch.ones(4)})
    path = _manifest_path(root)
    doc = json.loads(path.read_text())
    doc["objects"][0]["name"] = evil
    doc["entries"][0]["ranges"][0]["object"] = evil
    path.write_bytes(sign_manifest(doc))
    with SyncCheckpointer(small_config) as ckpt, pytest.raises(ManifestError, match="unsafe object name"):
        ckpt.load()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format_version=99), "format version 99"),
        (lambda d: d.update(format="other"), "not an aiosnap manifest"),
        (lambda d: d["entries"][0].update(shape=[3]), "shape"),
        (lambda d: d["entries"][0].update(dtype="os.system"), "unknown dtype"),
        (lambda d: d.update(tree={"t": "exec", "v": 1}), "unknown tree node"),
    ],
)
def test_invalid_manifests_are_refused(small_config: Config, root: Path, mutate: object, message: str) -> None:
    _save(small_config, {"x": torch.ones(4)})
    path = _manifest_path(root)
    doc = json.loads(path.read_text())
    mutate(doc)  # type: ignore[operator]
    path.write_bytes(sign_manifest(doc))
    with SyncCheckpointer(small_config) as ckpt, pytest.raises(ManifestError, match=message):
        ckpt.load()


def test_garbage_manifest_is_refused(small_config: Config, root: Path) -> None:
    _save(small_config, {"x": torch.ones(4)})
    _manifest_path(root).write_bytes(b"\x80not json")
    with SyncCheckpointer(small_config) as ckpt, pytest.raises(ManifestError, match="not valid JSON"):
        ckpt.load()
