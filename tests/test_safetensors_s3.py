"""Safetensors on S3: exports are one multipart upload per shard (parts of at least 5 MiB,
each with its CRC32C, which LocalStack checks), read back whole by the safetensors library;
imports read only the byte ranges they need; faults on the wire (connection resets mid-body)
are retried; an export that fails leaves no shard, no index and no open upload behind."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import Config, StorageUnavailableError, SyncCheckpointer
from aiosnap.interop.safetensors.api import export, open_safetensors
from aiosnap.interop.safetensors.destination import CLAIM_FILE
from aiosnap.interop.safetensors.export import ExportOptions, export_manifest
from aiosnap.interop.safetensors.layout import INDEX_FILE
from aiosnap.interop.safetensors.reader import SafetensorsFolder
from aiosnap.storage.registry import storage_from_url
from safetensors.torch import load
from tests.conftest import FaultyStorage, s3_config

pytestmark = pytest.mark.both_servers


def _state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(11)
    return {
        "model": {
            "embed.weight": torch.randn(1600, 1024, generator=generator),  # 6.5 MB: two 5 MiB parts and more
            "norm.weight": torch.randn(1024, generator=generator).to(torch.bfloat16),
            "head.weight": torch.randn(512, 1024, generator=generator),
        }
    }


def _save(root: Path) -> dict[str, Any]:
    state = _state()
    config = {"storage": {"url": str(root)}, "upload": {"chunk_size": "2MiB"}, "ram_budget": "16MiB"}
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(state, step=1).wait()
    return state


def _config(endpoint: str, bucket: str, **s3: Any) -> Config:
    config = s3_config(endpoint, bucket, **s3)
    return config.model_copy(update={"ram_budget": 32 * 1024**2})


def _objects(client: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix) :]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}


def _open_uploads(client: Any, bucket: str) -> list[Any]:
    return list(client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def test_export_to_s3_and_load_back(tmp_path: Path, s3_endpoint: str, s3_bucket: str, s3_client: Any) -> None:
    state = _save(tmp_path / "ckpt")
    config = _config(s3_endpoint, s3_bucket)
    report = export(str(tmp_path / "ckpt"), f"s3://{s3_bucket}/hf", config=config, max_shard_size="5MB")
    objects = _objects(s3_client, s3_bucket, "hf/")
    assert sorted(objects) == sorted(report.files)
    weight_map = json.loads(objects[INDEX_FILE])["weight_map"]
    found: dict[str, torch.Tensor] = {}
    for file in set(weight_map.values()):
        found.update(load(objects[file]))
    assert set(found) == set(state["model"])
    for name, value in state["model"].items():
        assert torch.equal(found[name], value), name
    assert _open_uploads(s3_client, s3_bucket) == []
    etag = s3_client.head_object(Bucket=s3_bucket, Key=f"hf/{weight_map['embed.weight']}")["ETag"].strip('"')
    assert int(etag.rsplit("-", 1)[1]) >= 2  # one multipart upload of several parts

    fresh = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    folder = SafetensorsFolder(FaultyStorage(storage_from_url(f"s3://{s3_bucket}/hf", config)))
    with SyncCheckpointer(config, storage=folder) as ckpt:
        ckpt.load(fresh)  # in place, through ranged GETs
        counted = folder.inner
        assert isinstance(counted, FaultyStorage)
        before = counted.read_bytes
        ckpt.load({"model": {"norm.weight": fresh["model"]["norm.weight"]}})
        assert counted.read_bytes - before == 2048  # the norm's bytes and nothing else
    for name, value in state["model"].items():
        assert torch.equal(fresh["model"][name], value), name


@pytest.mark.moto_only
def test_resets_mid_body_are_retried(tmp_path: Path, proxy: Any, s3_bucket: str, s3_client: Any) -> None:
    state = _save(tmp_path / "ckpt")
    proxy.reset_every = 2
    proxy.reset_after_bytes = 1024 * 1024
    config = _config(proxy.url, s3_bucket)
    export(str(tmp_path / "ckpt"), f"s3://{s3_bucket}/hf", config=config, max_shard_size="5MB")
    proxy.reset_every = 0
    assert proxy.resets > 0
    objects = _objects(s3_client, s3_bucket, "hf/")
    found: dict[str, torch.Tensor] = {}
    for file in set(json.loads(objects[INDEX_FILE])["weight_map"].values()):
        found.update(load(objects[file]))
    assert all(torch.equal(found[k], v) for k, v in state["model"].items())
    assert _open_uploads(s3_client, s3_bucket) == []


@pytest.mark.moto_only
def test_a_failed_export_leaves_nothing_behind(
    tmp_path: Path, s3_endpoint: str, s3_bucket: str, s3_client: Any
) -> None:
    """Completing the second shard fails after the first shard completed: the first shard
    is removed again, the open upload aborted, no index written."""
    _save(tmp_path / "ckpt")
    config = _config(s3_endpoint, s3_bucket)
    completed: list[str] = []

    async def run() -> None:
        from aiosnap.catalog.steps import manifest_of
        from aiosnap.storage.local import LocalStorage

        source = LocalStorage(tmp_path / "ckpt")
        manifest = await manifest_of(source, None)
        dest = FaultyStorage(
            storage_from_url(f"s3://{s3_bucket}/hf", config),
            fail_when=lambda what: what == "model-00002-of-00002.safetensors#complete",
            error=StorageUnavailableError("the store went away"),
        )
        try:
            await export_manifest(source, manifest, dest, ExportOptions(max_shard_size=5_000_000, concurrency=1))
        finally:
            completed.extend(w for w in dest.writes if w.endswith("#complete"))
            await dest.close()

    with pytest.raises(StorageUnavailableError, match="went away"):
        asyncio.run(run())
    assert completed == ["model-00001-of-00002.safetensors#complete"]
    assert _objects(s3_client, s3_bucket, "hf/") == {}
    assert _open_uploads(s3_client, s3_bucket) == []


@pytest.mark.moto_only
def test_what_a_killed_export_left_blocks_the_folder_then_goes(
    tmp_path: Path, s3_endpoint: str, s3_bucket: str, s3_client: Any
) -> None:
    """A process killed mid-export leaves its claim and open multipart uploads: the next
    export is refused while the claim is there; once it is removed, the export aborts the
    dead one's uploads of export names (nothing else) and publishes."""
    state = _save(tmp_path / "ckpt")
    config = _config(s3_endpoint, s3_bucket)
    s3_client.put_object(Bucket=s3_bucket, Key=f"hf/{CLAIM_FILE}", Body=b'{"owner": "dead"}')
    for key in ("hf/model-00001-of-00002.safetensors", "hf/model-00002-of-00002.safetensors", "hf/notes.bin"):
        s3_client.create_multipart_upload(Bucket=s3_bucket, Key=key)
    with pytest.raises(FileExistsError, match=f"delete {CLAIM_FILE}"):
        export(str(tmp_path / "ckpt"), f"s3://{s3_bucket}/hf", config=config, max_shard_size="5MB")
    s3_client.delete_object(Bucket=s3_bucket, Key=f"hf/{CLAIM_FILE}")
    export(str(tmp_path / "ckpt"), f"s3://{s3_bucket}/hf", config=config, max_shard_size="5MB")
    assert [u["Key"] for u in _open_uploads(s3_client, s3_bucket)] == ["hf/notes.bin"]
    with SyncCheckpointer(config, storage=open_safetensors(f"s3://{s3_bucket}/hf", config)) as ckpt:
        loaded = ckpt.load()
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
