"""aiosnap's DCP writer and reader on S3 protocol servers (moto, and LocalStack, which
checks every body's CRC32C), with the fault proxy resetting connections mid-body."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from aiosnap import Config, SyncCheckpointer, export
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


def test_export_to_s3_never_replaces_an_object_that_lands_after_the_check(
    s3_endpoint: str, s3_bucket: str, s3_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer's object appears at DEST between the export's look and its upload:
    the conditional upload refuses to replace it (FileExistsError, the object untouched).
    The file the export is assembled in lies in spool.dir, nameless while it is uploaded
    (a killed export leaves nothing), and is gone after."""
    from aiosnap.storage.s3 import S3Storage

    source = tmp_path / "small.pt"
    torch.save({"a": torch.arange(10.0)}, source)
    spool = tmp_path / "spool"
    config = Config(**{**s3_config(s3_endpoint, s3_bucket).model_dump(), "spool": {"dir": str(spool)}})
    real = S3Storage.exists
    assembled: list[str] = []

    async def someone_writes_after_the_look(self: S3Storage, name: str) -> bool:
        found = await real(self, name)
        if name == "theirs.pt":
            assert spool.is_dir() and not list(spool.iterdir())
            for fd in os.listdir("/proc/self/fd"):
                with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor
                    if (link := os.readlink(f"/proc/self/fd/{fd}")).startswith(str(spool)):
                        assembled.append(link)
            s3_client.put_object(Bucket=s3_bucket, Key="out/theirs.pt", Body=b"SOMEONE ELSE'S FILE")
        return found

    monkeypatch.setattr(S3Storage, "exists", someone_writes_after_the_look)
    with pytest.raises(FileExistsError, match="theirs.pt"):
        export(str(source), f"s3://{s3_bucket}/out/theirs.pt", to="torch", config=config)
    assert s3_client.get_object(Bucket=s3_bucket, Key="out/theirs.pt")["Body"].read() == b"SOMEONE ELSE'S FILE"
    assert len(assembled) == 1 and assembled[0].endswith(" (deleted)"), assembled
    assert not list(spool.iterdir())


def test_an_if_absent_file_upload_refuses_an_existing_object(s3_endpoint: str, s3_bucket: str, s3_client: Any,
                                                              tmp_path: Path) -> None:  # fmt: skip
    """write_file(if_absent=True) by one PUT and by a multipart upload (7 MiB, over the
    6 MiB threshold): FileExistsError, the object there untouched; to a free name, it lands."""
    import asyncio

    from aiosnap.storage.registry import storage_from_url

    config = s3_config(s3_endpoint, s3_bucket)
    s3_client.put_object(Bucket=s3_bucket, Key="up/taken", Body=b"theirs")
    small, large = tmp_path / "small", tmp_path / "large"
    small.write_bytes(b"x" * 100)
    large.write_bytes(b"y" * 7 * 1024**2)

    async def upload() -> None:
        storage = storage_from_url(f"s3://{s3_bucket}/up", config)
        try:
            for path in (small, large):
                with pytest.raises(FileExistsError):
                    await storage.write_file("taken", str(path), if_absent=True)
            await storage.write_file("free", str(large), if_absent=True)
        finally:
            await storage.close()

    asyncio.run(upload())
    assert s3_client.get_object(Bucket=s3_bucket, Key="up/taken")["Body"].read() == b"theirs"
    assert _keys(s3_client, s3_bucket, "up/")["up/free"] == 7 * 1024**2
