"""S3 storage against real S3 protocol servers (moto, and LocalStack, which checks every
body's CRC32C) with faults injected by a TCP proxy."""

from __future__ import annotations

import json
import logging
import socket
import time
from typing import Any

import pytest
import torch
from aiosnap import Config, StorageError, StorageUnavailableError, SyncCheckpointer
from aiosnap.config import S3Config
from aiosnap.storage.s3 import MIN_PART, S3Storage, part_size_for
from tests.conftest import assert_same, make_model, s3_config

MiB = 1024 * 1024


pytestmark = [pytest.mark.both_executors, pytest.mark.both_servers]


def _keys(client: Any, bucket: str, prefix: str = "") -> dict[str, int]:
    paginator = client.get_paginator("list_objects_v2")
    return {
        o["Key"]: o["Size"]
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix)
        for o in page.get("Contents", [])
    }


def _open_uploads(client: Any, bucket: str) -> list[Any]:
    return list(client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def test_round_trip_with_multipart_objects_matching_the_manifest(
    s3_endpoint: str, s3_bucket: str, s3_client: Any
) -> None:
    model = make_model()
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    optim.step()
    big = torch.randn(8_000_000)  # 32 MB: three 12 MiB objects, each a multipart upload of 5 MiB parts
    state = {"model": model, "optim": optim, "big": big, "meta": {"epoch": 3, "name": "run"}}
    with SyncCheckpointer(s3_config(s3_endpoint, s3_bucket)) as ckpt:
        assert ckpt.url == f"s3://{s3_bucket}/run"
        ckpt.save(state, step=42, metadata={"note": "s3"}).wait()
        assert ckpt.steps() == [42]
        manifest = ckpt.manifest()
        restored = ckpt.load()
    assert torch.equal(restored["big"], big)
    assert_same(restored["model"], model.state_dict())
    assert restored["meta"] == {"epoch": 3, "name": "run"}
    on_server = _keys(s3_client, s3_bucket, "run/")
    expected = {f"run/{o.name}": o.nbytes for o in manifest.objects} | {"run/000000000042/manifest.json": None}
    assert set(on_server) == set(expected)
    assert all(on_server[k] == size for k, size in expected.items() if size is not None)
    assert sum(1 for o in manifest.objects if o.nbytes > 6 * MiB) >= 2, "multipart uploads were exercised"
    assert _open_uploads(s3_client, s3_bucket) == []


def test_retention_and_listing_only_show_committed_steps(s3_endpoint: str, s3_bucket: str, s3_client: Any) -> None:
    base = s3_config(s3_endpoint, s3_bucket)
    config = base.model_copy(update={"retention": base.retention.model_copy(update={"keep_last": 2})})
    s3_client.put_object(Bucket=s3_bucket, Key="run/000000000099/abc/rank-0/0.bin", Body=b"uncommitted")
    with SyncCheckpointer(config) as ckpt:
        for step in (1, 2, 3):
            ckpt.save({"x": torch.full((1000,), float(step))}, step=step).wait()
        assert ckpt.steps() == [2, 3]
        assert torch.equal(ckpt.load(step=2)["x"], torch.full((1000,), 2.0))
    assert not any(k.startswith("run/000000000001/") for k in _keys(s3_client, s3_bucket))


def test_connection_resets_mid_body_are_retried(s3_endpoint: str, s3_bucket: str, proxy: Any) -> None:
    proxy.reset_every = 3
    proxy.reset_after_bytes = 512 * 1024
    state = {"w": torch.randn(6_000_000)}  # 24 MB
    with SyncCheckpointer(s3_config(proxy.url, s3_bucket)) as ckpt:
        ckpt.save(state, step=1).wait(120)
        restored = ckpt.load()
    assert proxy.resets > 0
    assert torch.equal(restored["w"], state["w"])


def test_slowdown_responses_are_retried(s3_endpoint: str, s3_bucket: str, proxy: Any) -> None:
    proxy.slowdown_requests = 4
    with SyncCheckpointer(s3_config(proxy.url, s3_bucket)) as ckpt:
        ckpt.save({"x": torch.arange(100)}, step=1).wait(60)
        assert torch.equal(ckpt.load()["x"], torch.arange(100))
    assert proxy.slowdowns == 4


def test_bandwidth_cap_is_what_the_upload_achieves(s3_endpoint: str, s3_bucket: str, proxy: Any) -> None:
    cap = 16 * 1e6
    proxy.set_rate(cap)
    state = {"w": torch.randn(8_000_000)}  # 32 MB
    with SyncCheckpointer(s3_config(proxy.url, s3_bucket)) as ckpt:
        result = ckpt.save(state, step=1).wait(120)
    rate = result.nbytes / result.durable_s
    print(f"upload through a {cap / 1e6:.0f} MB/s cap: {rate / 1e6:.1f} MB/s")
    assert rate <= cap * 1.15
    assert rate >= cap * 0.3


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.moto_only  # the save under test reaches no server at all
def test_unreachable_server_fails_typed_within_the_deadline(s3_endpoint: str, s3_bucket: str, s3_client: Any) -> None:
    with SyncCheckpointer(s3_config(s3_endpoint, s3_bucket)) as ckpt:
        ckpt.save({"x": torch.zeros(10)}, step=1).wait()
    before = _keys(s3_client, s3_bucket)
    dead = s3_config(f"http://127.0.0.1:{_closed_port()}", s3_bucket, retry_deadline=1.5, request_timeout=1)
    ckpt = SyncCheckpointer(dead)
    started = time.monotonic()
    handle = ckpt.save({"x": torch.ones(10)}, step=2)
    with pytest.raises(StorageUnavailableError, match="retry deadline") as info:
        handle.wait(30)
    assert time.monotonic() - started < 1.5 + 1 + 4  # deadline + one attempt's timeout + slack (a loaded machine)
    assert info.value.__cause__ is not None
    ckpt.close()  # reported at wait(), not again
    assert _keys(s3_client, s3_bucket) == before, "nothing written, the previous checkpoint untouched"
    with SyncCheckpointer(s3_config(s3_endpoint, s3_bucket)) as good:
        assert good.steps() == [1]


def test_interrupted_multipart_upload_is_aborted(s3_endpoint: str, s3_bucket: str, s3_client: Any, proxy: Any) -> None:
    proxy.reset_every = 1  # every connection dies once 256 KiB of a body went through
    config = s3_config(proxy.url, s3_bucket, retry_deadline=2)
    ckpt = SyncCheckpointer(config)
    with pytest.raises(StorageUnavailableError):
        ckpt.save({"w": torch.randn(4_000_000)}, step=1).wait(60)
    ckpt.close()
    assert _open_uploads(s3_client, s3_bucket) == []
    assert not any(k.endswith("manifest.json") for k in _keys(s3_client, s3_bucket))


def test_missing_bucket_is_a_typed_error_at_once(s3_endpoint: str) -> None:
    ckpt = SyncCheckpointer(s3_config(s3_endpoint, "no-such-bucket-here"))
    with pytest.raises(StorageError, match="NoSuchBucket"):
        ckpt.save({"x": torch.ones(1)}, step=1).wait(30)
    ckpt.close()


def test_credentials_never_show_in_logs_errors_or_manifests(
    s3_endpoint: str, s3_bucket: str, s3_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "SECRET-aiosnap-do-not-print-0123456789"
    caplog.set_level(logging.DEBUG)
    good = s3_config(s3_endpoint, s3_bucket, access_key_id="aiosnap-test-key", secret_access_key=secret)
    with SyncCheckpointer(good) as ckpt:
        ckpt.save({"x": torch.ones(3)}, step=1).wait()
    manifest = s3_client.get_object(Bucket=s3_bucket, Key="run/000000000001/manifest.json")["Body"].read()
    dead = s3_config(
        f"http://127.0.0.1:{_closed_port()}",
        s3_bucket,
        retry_deadline=0.5,
        access_key_id="aiosnap-test-key",
        secret_access_key=secret,
    )
    ckpt = SyncCheckpointer(dead)
    with pytest.raises(StorageUnavailableError) as info:
        ckpt.save({"x": torch.ones(3)}, step=2).wait(30)
    ckpt.close()
    texts = [caplog.text, str(info.value), repr(info.value.__cause__), manifest.decode(), repr(dead), str(dead)]
    assert all(secret not in text for text in texts)
    assert json.loads(manifest)["metadata"] == {}


async def test_conditional_write_never_overwrites(s3_endpoint: str, s3_bucket: str) -> None:
    storage = S3Storage(s3_bucket, "cond", S3Config(endpoint_url=s3_endpoint, addressing_style="path"))
    try:
        await storage.write("m.json", b"first", if_absent=True)
        with pytest.raises(FileExistsError):
            await storage.write("m.json", b"second", if_absent=True)
        assert await storage.read("m.json") == b"first"
        await storage.write("m.json", b"third")
        assert await storage.read("m.json") == b"third"
        assert await storage.exists("m.json")
        assert not await storage.exists("nope")
        with pytest.raises(FileNotFoundError):
            await storage.read("nope")
        dest = bytearray(3)
        assert await storage.read_into("m.json", 3, memoryview(dest)) == 2
        assert await storage.read_into("m.json", 10, memoryview(bytearray(3))) == 0
    finally:
        await storage.close()


def test_part_sizes_respect_s3_limits() -> None:
    assert part_size_for(100 * MiB, 1 * MiB) == MIN_PART
    assert part_size_for(100 * MiB, 8 * MiB) == 8 * MiB
    huge = 100_000 * MiB
    assert part_size_for(huge, 8 * MiB) * 10_000 >= huge


def test_s3_config_validation() -> None:
    with pytest.raises(ValueError, match="together"):
        S3Config(access_key_id="k")
    with pytest.raises(ValueError, match="part_concurrency"):
        Config(s3={"part_concurrency": 0})
    assert "s3cret" not in repr(S3Config(access_key_id="k", secret_access_key="s3cret"))


def test_stalled_bodies_are_timed_out_and_retried(s3_server: str, s3_bucket: str, proxy: Any) -> None:
    if s3_server == "localstack":
        pytest.skip("LocalStack makes a re-sent part wait while an earlier, stalled body of it is still open")
    proxy.stall_every = 2
    proxy.stall_limit = 4
    proxy.reset_after_bytes = 512 * 1024
    state = {"w": torch.randn(4_000_000)}  # 16 MB
    with SyncCheckpointer(s3_config(proxy.url, s3_bucket, request_timeout=1)) as ckpt:
        ckpt.save(state, step=1).wait(120)
        proxy.clear()
        assert torch.equal(ckpt.load()["w"], state["w"])
    assert proxy.stalls > 0


def test_missing_aiobotocore_gives_an_install_hint() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['aiobotocore'] = None\n"
        "from aiosnap.storage.registry import storage_from_url\n"
        "try:\n    storage_from_url('s3://bucket/prefix')\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert "pip install 'aiosnap[s3]'" in out.stdout


async def test_aborting_an_upload_already_gone_is_success(
    s3_endpoint: str, s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    storage = S3Storage(s3_bucket, "gone", S3Config(endpoint_url=s3_endpoint, addressing_style="path"))
    try:
        await storage._abort("x.bin", "gone/x.bin", "an-upload-id-that-no-longer-exists")  # NoSuchUpload
    finally:
        await storage.close()
    assert "could not abort" not in caplog.text
