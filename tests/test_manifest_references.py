"""Format version 4: a manifest may name objects of earlier saves (``references``) and carry
range digests. Hand-edited references are checked like everything else a manifest says."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import Config, ManifestError, SyncCheckpointer
from aiosnap.core.names import attempt_of_object, step_dir
from aiosnap.format.manifest import INCREMENTAL_VERSION, Manifest, version_for
from tests.fuzzing import sign_manifest


def _two_steps(config: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    with SyncCheckpointer(config) as ckpt:
        ckpt.save({"a": torch.arange(8.0), "b": torch.ones(4)}, step=1).wait()
        ckpt.save({"a": torch.arange(8.0), "b": torch.zeros(4)}, step=2).wait()
    root = Path(config.storage.url)
    return (json.loads((root / step_dir(s) / "manifest.json").read_text()) for s in (1, 2))  # type: ignore[return-value]


def _referencing(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Step 2's document, its entry ``a`` naming step 1's range instead of its own."""
    doc = json.loads(json.dumps(second))
    first_a = next(e for e in first["entries"] if e["path"] == "a")
    doc["entries"][[e["path"] for e in doc["entries"]].index("a")]["ranges"] = first_a["ranges"]
    doc["references"] = [o for o in first["objects"] if o["name"] == first_a["ranges"][0]["object"]]
    doc["format_version"] = INCREMENTAL_VERSION
    doc.pop("crc32c")
    return doc


def test_a_reference_to_an_earlier_save_validates_and_counts_as_stored(small_config: Config) -> None:
    first, second = _two_steps(small_config)
    manifest = Manifest.from_json(sign_manifest(_referencing(first, second)), "m")
    assert version_for(manifest) == INCREMENTAL_VERSION
    assert [o.name for o in manifest.stored_objects()][-1] == manifest.references[0].name  # type: ignore[index]
    assert manifest.own_bytes < manifest.total_bytes
    assert attempt_of_object(manifest.references[0].name) == (1, first["save_id"])  # type: ignore[index]
    assert attempt_of_object("000000000001/not-an-id/x") is None and attempt_of_object("a/b/c") is None


def _first_range(doc: dict[str, Any]) -> list[Any]:
    found = doc["entries"][0]["ranges"][0]
    return [found["object"], found["offset"]]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d, f: d.update(format_version=3), "no references"),
        (lambda d, f: d["references"][0].update(name="../x/y"), "unsafe object name"),
        (lambda d, f: d["references"][0].update(name="elsewhere/obj"), "not an object of another save"),
        (lambda d, f: d["references"][0].update(name=d["objects"][0]["name"]), "not an object of another save"),
        (
            lambda d, f: d["references"][0].update(
                name=d["references"][0]["name"].replace("000000000001", "000000000007")
            ),
            "not one before step 2",
        ),
        (lambda d, f: d["references"].append(dict(d["references"][0])), "listed twice"),
        (lambda d, f: d["references"][0].update(nbytes=1), "runs past the end"),
        (lambda d, f: d["references"][0].update(rank=3), "world size"),
        (lambda d, f: d.update(digests=[[*_first_range(d), "ab" * 16]]), None),
        (lambda d, f: d.update(digests=[[_first_range(d)[0], 1, "ab" * 16]]), "no such range"),
        (lambda d, f: d.update(digests=[[*_first_range(d), "AB" * 16]]), "hex"),
        (lambda d, f: d.update(digests=[[*_first_range(d), "ab" * 16]] * 2), "listed twice"),
    ],
)
def test_forged_references_and_digests_are_manifest_errors(
    small_config: Config, change: Any, message: str | None
) -> None:
    first, second = _two_steps(small_config)
    doc = _referencing(first, second)
    change(doc, first)
    if message is None:
        Manifest.from_json(sign_manifest(doc), "m")
        return
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(sign_manifest(doc), "m")
