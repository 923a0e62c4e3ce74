"""What the tools say about a step that references earlier steps' objects (issue 24): ``aiosnap
info``/``verify``/``ls`` show own and referenced bytes; hand-edited references are refused at
load (CorruptCheckpointError) and reported by verify; ``aiosnap download`` copies the
referenced bytes so that the copy stands alone."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiosnap import ChecksumMismatchError, Config, CorruptCheckpointError, SyncCheckpointer
from aiosnap.core.names import step_dir
from tests.conftest import CliRunner, assert_same, s3_config
from tests.fuzzing import sign_manifest
from tests.referencing import frozen_chain, on_root


def _doc(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / step_dir(step) / "manifest.json").read_text())  # type: ignore[no-any-return]


def _load(config: Config, step: int) -> Any:
    with SyncCheckpointer(config) as ckpt:
        return ckpt.load(step=step)


def test_info_verify_and_ls_show_own_and_referenced_bytes(aiosnap: CliRunner, small_config: Config) -> None:
    frozen_chain(small_config, [1, 2])
    root = small_config.storage.url
    first, second = _doc(Path(root), 1), _doc(Path(root), 2)
    own = sum(o["nbytes"] for o in second["objects"])
    referenced = sum(o["nbytes"] for o in second["references"])

    info = json.loads(aiosnap("info", root, "--step", "2", "--json").stdout)
    assert (info["own_bytes"], info["total_bytes"]) == (own, own + referenced)
    (earlier,) = info["referenced_steps"]
    assert earlier == {
        "step": 1, "save_id": first["save_id"], "objects": len(second["references"]), "nbytes": referenced,
        "range_bytes": referenced,  # the frozen base fills its objects
    }  # fmt: skip
    text = aiosnap("info", root, "--step", "2").stdout
    assert "referenced step" in text and first["save_id"] in text and "own:" in text
    assert "own:" not in aiosnap("info", root, "--step", "1").stdout

    checked = json.loads(aiosnap("verify", root, "--step", "2", "--json").stdout)
    assert checked["ok"] and checked["own_bytes"] == own and checked["stored_bytes"] == own + referenced
    assert checked["referenced_steps"][0]["step"] == 1
    assert "of earlier step(s) 1" in aiosnap("verify", root, "--step", "2").stdout

    listed = {s["step"]: s for s in json.loads(aiosnap("ls", root, "--json").stdout)}
    assert listed[2]["own_bytes"] == own and listed[2]["nbytes"] == own + referenced
    assert listed[1]["own_bytes"] == listed[1]["nbytes"]
    assert "own" in aiosnap("ls", root).stdout

    report = json.loads(aiosnap("gc", root, "--keep-last", "1", "--grace", "0s", "--json").stdout)
    assert report["deleted_steps"] == [1] and report["kept_referenced"] == [f"{step_dir(1)}/{first['save_id']}"]
    report = json.loads(aiosnap("gc", root, "--keep-last", "1", "--grace", "0s", "--json").stdout)
    assert report["deleted_steps"] == [] and report["kept_referenced"] == [f"{step_dir(1)}/{first['save_id']}"]
    assert "later steps reference" in aiosnap("gc", root, "--keep-last", "1", "--grace", "0s").stdout
    everything = json.loads(aiosnap("ls", root, "--all", "--json").stdout)
    assert [(s["step"], s["state"], s["nbytes"]) for s in everything] == [
        (1, "referenced", referenced),
        (2, "committed", own + referenced),
    ]
    assert json.loads(aiosnap("verify", root, "--json").stdout)["ok"]


def _edit_references(root: Path, change: Callable[[str], str]) -> str:
    """Rename step 2's first referenced object (in its references and its ranges), re-signed."""
    doc = _doc(root, 2)
    old = doc["references"][0]["name"]
    new = change(old)
    doc["references"][0]["name"] = new
    for entry in doc["entries"]:
        for r in entry["ranges"]:
            if r["object"] == old:
                r["object"] = new
    (root / step_dir(2) / "manifest.json").write_bytes(sign_manifest(doc))
    return new


def _first_reference(root: Path) -> Path:
    return root / _doc(root, 2)["references"][0]["name"]


def _fifo_for_first_reference(root: Path) -> None:
    """A FIFO where a referenced object was (opening it to read would wait for a writer)."""
    path = _first_reference(root)
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize(
    ("damage", "error", "load_says", "verify_says"),
    [
        (
            lambda root: _edit_references(root, lambda n: "000000000000" + n[12:]),
            CorruptCheckpointError,
            "missing",
            "in step folder 000000000000, which does not exist",
        ),
        (
            lambda root: _edit_references(root, lambda n: n[:13] + "0123456789abcdef" + n[29:]),
            CorruptCheckpointError,
            "missing",
            "of attempt 000000000001/0123456789abcdef, which does not exist",
        ),
        (lambda root: _first_reference(root).unlink(), CorruptCheckpointError, "referenced, of step 1", "is missing"),
        (
            lambda root: _first_reference(root).write_bytes(_first_reference(root).read_bytes() + b"x"),
            CorruptCheckpointError,
            "the manifest says",
            "the manifest says",
        ),
        (
            lambda root: _first_reference(root).write_bytes(b"\x01" + _first_reference(root).read_bytes()[1:]),
            ChecksumMismatchError,
            "checksum",
            "checksum mismatch",
        ),
        (_fifo_for_first_reference, CorruptCheckpointError, "referenced, of step 1", "is missing"),
    ],
    ids=["step-folder-never-existed", "attempt-never-existed", "object-missing", "wrong-size", "crc-mismatch", "fifo"],
)
def test_hand_edited_references_are_refused_at_load_and_reported_by_verify(
    aiosnap: CliRunner, small_config: Config, damage: Any, error: type[Exception], load_says: str, verify_says: str
) -> None:
    frozen_chain(small_config, [1, 2])
    root = Path(small_config.storage.url)
    if _first_reference(root).read_bytes()[:1] == b"\x01":
        pytest.skip("the first byte is already 0x01")  # the flip would change nothing
    damage(root)
    with pytest.raises(error, match=load_says):
        _load(small_config, 2)
    verdict = aiosnap("verify", str(root), "--step", "2", "--json")
    assert verdict.returncode == 1
    problems = json.loads(verdict.stdout)["problems"]
    assert any(verify_says in p for p in problems), problems


def test_download_copies_referenced_bytes_so_the_copy_stands_alone(
    aiosnap: CliRunner, small_config: Config, tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
    states = frozen_chain(small_config, [1, 2, 3])
    source = small_config.storage.url
    local = tmp_path / "copy"
    bucket = s3_config(moto_endpoint, s3_bucket)
    config = tmp_path / "s3.yaml"
    config.write_text(json.dumps({"s3": {"endpoint_url": moto_endpoint, "addressing_style": "path"}}))
    for step in (2, 3):  # step 3's references are in the destination already after step 2's copy
        assert json.loads(aiosnap("download", source, str(local), "--step", str(step), "--json").stdout)["copied"]
    done = aiosnap("download", source, bucket.storage.url, "--step", "3", "--config", str(config), "--json")
    assert json.loads(done.stdout)["copied"], done.stderr
    exported = tmp_path / "exported"  # an export reads through the load path: written whole
    assert aiosnap("export", source, str(exported), "--to", "aiosnap", "--step", "3").returncode == 0
    shutil.rmtree(source)
    copies = [
        small_config.model_copy(update={"storage": small_config.storage.model_copy(update={"url": str(local)})}),
        bucket,
    ]
    for copy in copies:
        assert_same(_load(copy, 3), states[3])
        assert on_root(copy, lambda s: s.exists(f"{step_dir(1)}/manifest.json")) is False
    assert_same(_load(copies[0], 2), states[2])
    alone = small_config.model_copy(update={"storage": small_config.storage.model_copy(update={"url": str(exported)})})
    assert_same(_load(alone, 3), states[3])
    assert json.loads(aiosnap("gc", str(local), "--keep-last", "1", "--grace", "0s", "--json").stdout)[
        "kept_referenced"
    ]
    assert_same(_load(copies[0], 3), states[3])
    assert json.loads(aiosnap("verify", str(local), "--json").stdout)["ok"]
