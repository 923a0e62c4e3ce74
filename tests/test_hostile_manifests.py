"""Manifests are untrusted input: every malformed or hostile one is a ManifestError (or another
CorruptCheckpointError), never another exception type, never pickled code run, never a huge
allocation."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import (
    Config,
    CorruptCheckpointError,
    ManifestError,
    PickleNotAllowedError,
    SyncCheckpointer,
    TruncatedObjectError,
)
from aiosnap.core.names import step_dir
from tests.fuzzing import sign_manifest


def _manifest_path(root: Path, step: int = 1) -> Path:
    return root / step_dir(step) / "manifest.json"


def _save(config: Config, state: dict[str, Any], step: int = 1) -> None:
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(state, step=step).wait()


def _rewrite(root: Path, change: Any, step: int = 1) -> None:
    """Edit a manifest as someone who may write the storage can: checksum recomputed."""
    path = _manifest_path(root, step)
    doc = json.loads(path.read_text())
    change(doc)
    path.write_bytes(sign_manifest(doc))


def test_an_edit_without_a_matching_checksum_is_damage(small_config: Config, root: Path) -> None:
    _save(small_config, {"x": torch.ones(4)})
    path = _manifest_path(root)
    path.write_bytes(path.read_bytes().replace(b'"shape":[4]', b'"shape":[2,2]'))
    with SyncCheckpointer(small_config) as ckpt, pytest.raises(ManifestError, match="damaged"):
        ckpt.load()


class _Touch:
    """Unpickling this creates a file: proof that attacker code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_a_tensor_leaf_relabelled_as_pickle_runs_no_code(small_config: Config, root: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = torch.frombuffer(bytearray(pickle.dumps(_Touch(marker))), dtype=torch.uint8)
    _save(small_config, {"weights": payload})  # the attacker can write data objects too

    _rewrite(root, lambda d: d.update(tree={"t": "dict", "items": [["weights", {"t": "pickle", "id": 0}]]}))
    with SyncCheckpointer(small_config) as ckpt, pytest.raises(ManifestError, match="pickle node names entry 0"):
        ckpt.load()
    assert not marker.exists()

    def relabel_entry_too(doc: dict[str, Any]) -> None:  # consistent: a real pickle entry now
        doc["entries"][0]["kind"] = "pickle"

    _rewrite(root, relabel_entry_too)
    with SyncCheckpointer(small_config) as ckpt:
        with pytest.raises(PickleNotAllowedError, match="allow_pickle=True"):
            ckpt.load()
        with pytest.raises(PickleNotAllowedError):
            ckpt.load({"weights": torch.zeros(3)})
    assert not marker.exists(), "no opt-in, no unpickling"


def test_the_decoder_itself_enforces_the_opt_in() -> None:
    from aiosnap.load.decode import TreeDecoder

    decode = TreeDecoder(lambda i: torch.zeros(1, dtype=torch.uint8), ["pickle"], ["p"], allow_pickle=False, where="x")
    with pytest.raises(PickleNotAllowedError):
        decode({"t": "pickle", "id": 0})
    with pytest.raises(ManifestError, match="not a tensor"):
        decode({"t": "tensor", "id": 0})


def _nested(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"t": "list", "items": [1]}
    for _ in range(depth):
        node = {"t": "list", "items": [node]}
    return node


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(tree={"t": "tensor", "id": 7}), "names no entry"),
        (lambda d: d.update(tree={"t": "tensor", "id": True}), "names no entry"),
        (lambda d: d.update(tree={"t": "list", "items": 5}), "items must be a list"),
        (lambda d: d.update(tree={"t": "dict", "items": [[1]]}), r"\[key, value\]"),
        (lambda d: d.update(tree={"t": "dict", "items": [[{"t": "list", "items": []}, 1]]}), "cannot be a dict key"),
        (lambda d: d.update(tree={"t": "size", "items": ["a"]}), "size node"),
        (lambda d: d.update(tree={"t": "bytes", "v": "!!!"}), "base64"),
        (lambda d: d.update(tree={"t": "device", "v": "warp:9"}), "device node"),
        (lambda d: d.update(tree={"t": "float", "v": 3}), "float as text"),
        (lambda d: d.update(tree={"t": "list", "items": [], "extra": 1}), "unexpected field"),
        (lambda d: d.update(tree={"t": "dict", "items": [], "meta": False}), "unexpected field"),  # found by the fuzzer
        (lambda d: d.update(tree=_nested(150)), "nested deeper"),
        (lambda d: d.update(format_version=True), "format version True"),
        (lambda d: d.update(format_version=-7), "format version -7"),
        (lambda d: d.update(format_version=6), "format version 6"),
        (lambda d: d.update(step=True), "step"),
        (lambda d: d.update(save_id="../../etc"), "invalid save id"),
        (lambda d: d["entries"][0].update(nbytes=True), "nbytes"),
        (lambda d: d["entries"][0].update(shape=[10**30]), "invalid shape"),
        (lambda d: d["entries"][0]["ranges"][0].update(offset="0"), "offset"),
    ],
)
def test_malformed_manifests_are_manifest_errors(small_config: Config, root: Path, change: Any, message: str) -> None:
    _save(small_config, {"x": torch.ones(4)})
    _rewrite(root, change)
    with SyncCheckpointer(small_config) as ckpt, pytest.raises(ManifestError, match=message) as info:
        ckpt.load()
    assert "manifest.json" in str(info.value) or "step 1" in str(info.value), "the message names the file"


def test_json_nested_beyond_the_parser_stack_is_a_manifest_error(small_config: Config, root: Path) -> None:
    _save(small_config, {"x": torch.ones(4)})
    doc = json.loads(_manifest_path(root).read_text())
    text = sign_manifest(doc).decode().replace('"tree": ', '"tree": ' + "[" * 100_000, 1)
    text = text.replace(', "metadata"', "]" * 100_000 + ', "metadata"', 1)
    _manifest_path(root).write_text(text)
    with SyncCheckpointer(small_config) as ckpt, pytest.raises(ManifestError):
        ckpt.load()


def test_objects_outside_the_saves_own_folder_are_refused(small_config: Config, root: Path) -> None:
    _save(small_config, {"x": torch.ones(4)}, step=1)
    other = json.loads(_manifest_path(root, 1).read_text())
    _save(small_config, {"x": torch.zeros(4)}, step=2)

    def borrow(doc: dict[str, Any]) -> None:  # step 2's manifest pointing at step 1's objects
        doc["objects"] = other["objects"]
        doc["entries"] = other["entries"]

    _rewrite(root, borrow, step=2)
    with SyncCheckpointer(small_config) as ckpt, pytest.raises(ManifestError, match="outside this save's folder"):
        ckpt.load(step=2)


def test_a_declared_size_larger_than_the_stored_object_allocates_nothing(small_config: Config, root: Path) -> None:
    _save(small_config, {"x": torch.ones(4)})
    huge = 2**40  # a terabyte

    def inflate(doc: dict[str, Any]) -> None:
        doc["objects"][0]["nbytes"] = huge
        entry = doc["entries"][0]
        entry.update(shape=[huge // 4], stride=[1], nbytes=huge)
        entry["ranges"] = [{**entry["ranges"][0], "nbytes": huge, "offset": 0}]

    _rewrite(root, inflate)
    with SyncCheckpointer(small_config) as ckpt, pytest.raises(TruncatedObjectError, match="truncated"):
        ckpt.load()


def test_a_manifest_for_another_step_is_refused(small_config: Config, root: Path) -> None:
    _save(small_config, {"x": torch.ones(4)}, step=1)
    (root / step_dir(9)).mkdir()
    _manifest_path(root, 9).write_bytes(_manifest_path(root, 1).read_bytes())
    with SyncCheckpointer(small_config) as ckpt, pytest.raises(CorruptCheckpointError, match="says step 1"):
        ckpt.load(step=9)


def test_overlapping_ranges_cannot_multiply_an_allocation(small_config: Config, root: Path) -> None:
    _save(small_config, {"x": torch.ones(1000)})

    def repeat(doc: dict[str, Any]) -> None:  # the same stored bytes, loaded 512 times
        entry = doc["entries"][0]
        entry["ranges"] = entry["ranges"] * 512
        entry.update(shape=[1000 * 512], stride=[1], nbytes=4000 * 512)

    _rewrite(root, repeat)
    with SyncCheckpointer(small_config) as ckpt, pytest.raises(ManifestError, match="overlap"):
        ckpt.load()


@pytest.mark.parametrize("entry", [5, -1])
def test_a_save_spec_naming_an_entry_it_does_not_have_is_refused(entry: int) -> None:
    """Found by the journal fuzzer (`make soak`): a spool journal's spec whose piece names an
    entry out of range raised IndexError (or, at -1, would have given the bytes to the last
    entry) instead of being refused."""
    from aiosnap.format.manifest import build_manifest
    from aiosnap.format.spec import SaveSpec
    from aiosnap.trainer.plan import make_plan

    plan = make_plan({"a": torch.ones(4), "b": torch.zeros(2)}, step=1, chunk_bytes=1 << 20)
    doc = plan.spec.to_document()
    doc["chunks"][0]["pieces"][0]["entry"] = entry
    with pytest.raises(ValueError, match="entries"):
        build_manifest(SaveSpec.from_document(doc))


@pytest.mark.parametrize(
    ("keys", "twice"),
    [
        (["a", "a"], True),
        ([1, True], True),  # one key in a Python dict
        ([1, {"t": "float", "v": "1.0"}], True),
        ([{"t": "tuple", "items": [1, 2]}, {"t": "size", "items": [1, 2]}], True),  # torch.Size == tuple
        (["1", 1], False),
        ([{"t": "dtype", "v": "float32"}, {"t": "tuple", "items": ["dtype", "float32"]}], False),
        ([{"t": "bytes", "v": "YQ=="}, "a"], False),
    ],
)
def test_a_dict_holding_one_key_twice_is_refused(keys: list[Any], twice: bool) -> None:
    """A manifest's dict naming one key twice (as Python compares keys) would lose a value
    on load: the tree is refused instead."""
    from aiosnap.format.tree import check_tree

    tree = {"t": "dict", "items": [[key, n] for n, key in enumerate(keys)]}
    if twice:
        with pytest.raises(ValueError, match="twice"):
            check_tree(tree, [])
    else:
        check_tree(tree, [])
