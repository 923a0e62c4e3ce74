"""aiosnap's DCP writer and reader on S3 protocol servers (moto, and LocalStack, which
checks every body's CRC32C), with the fault proxy resetting connections mid-body."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from aiosnap import SyncCheckpointer, export
from aiosnap.dcp import StorageReader, StorageWriter, checkpoint_storage, load
from tests.conftest import assert_same, s3_config
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

pytestmark = [
    pytest.mark.both_servers,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(90),
]


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {
        "model": {"big": torch.randn(4_000_000, generator=g), "small": torch.randn(10, 3, generator=g)},
        "step": 11,
    }


def _keys(client: Any, bucket: str, prefix: str) -> dict[str, int]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def test_dcp_on_s3_round_trip(s3_endpoint: str, s3_bucket: str, s3_client: Any) -> None:
    config = s3_config(s3_endpoint, s3_bucket)
    url = f"s3://{s3_bucket}/dcp/step-1"
    state = _state()
    dcp.save(state, storage_writer=StorageWriter(url, config), no_dist=True)
    keys = _keys(s3_client, s3_bucket, "dcp/step-1/")
    assert "dcp/step-1/.metadata" in keys
    assert max(keys.values()) > 6 * 1024**2  # files over the multipart threshold: parts in parallel
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    target = {"model": {"big": torch.zeros(4_000_000), "small": torch.zeros(10, 3)}, "step": None}
    dcp.load(target, storage_reader=StorageReader(url, config), no_dist=True)
    assert_same(target["model"], state["model"])
    assert target["step"] == 11
    restored = load(None, url, config=config)  # aiosnap's own load path, on S3
    assert_same(restored["model"], state["model"])
    with SyncCheckpointer(config, storage=checkpoint_storage(url, config)) as ckpt:
        assert ckpt.steps() == [0]
        assert ckpt.load(paths=["step"]) == {"step": 11}
    state["model"]["small"] += 1
    dcp.save(state, storage_writer=StorageWriter(url, config), no_dist=True)  # an overwrite
    after = _keys(s3_client, s3_bucket, "dcp/step-1/")
    attempts = {k.rsplit(".", 2)[1] for k in after if k.endswith(".distcp")}
    assert len(attempts) == 1 and not attempts & {k.rsplit(".", 2)[1] for k in keys if k.endswith(".distcp")}
    assert_same(load(None, url, config=config)["model"], state["model"])


def test_async_save_through_connection_resets(s3_endpoint: str, s3_bucket: str, proxy: Any) -> None:
    proxy.reset_every = 3
    proxy.reset_after_bytes = 512 * 1024
    config = s3_config(proxy.url, s3_bucket)
    url = f"s3://{s3_bucket}/dcp/resets"
    state = _state()
    writer = StorageWriter(url, config)
    future = dcp.async_save(
        state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.THREAD, no_dist=True
    )  # fmt: skip
    future.result(timeout=60)
    assert proxy.resets > 0
    target = {"model": {"big": torch.zeros(4_000_000), "small": torch.zeros(10, 3)}, "step": None}
    dcp.load(target, storage_reader=StorageReader(url, config), no_dist=True)
    assert_same(target["model"], state["model"])


def test_export_to_and_from_s3(s3_endpoint: str, s3_bucket: str, s3_client: Any, tmp_path: Path) -> None:
    config = s3_config(s3_endpoint, s3_bucket)
    state = _state()
    torch.save(state, tmp_path / "plain.pt")
    dcp_url = f"s3://{s3_bucket}/exported/dcp"
    export(str(tmp_path / "plain.pt"), dcp_url, to="dcp", config=config)
    assert "exported/dcp/.metadata" in _keys(s3_client, s3_bucket, "exported/dcp/")
    export(dcp_url, str(tmp_path / "back.pt"), to="torch", config=config)  # a DCP folder on S3, detected
    assert_same(torch.load(tmp_path / "back.pt", weights_only=True), state)
    file_url = f"s3://{s3_bucket}/exported/one.pt"
    export(dcp_url, file_url, to="torch", config=config)
    s3_client.download_file(s3_bucket, "exported/one.pt", str(tmp_path / "one.pt"))
    assert_same(torch.load(tmp_path / "one.pt", weights_only=True), state)
    export(file_url, str(tmp_path / "root"), to="aiosnap", config=config)  # a torch.save object on S3, detected
    with SyncCheckpointer({"storage": {"url": str(tmp_path / "root")}, "events": {"log": False}}) as ckpt:
        assert_same(ckpt.load(), state)
