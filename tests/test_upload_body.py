"""The upload body path: bytes go out as views of the staging arena, each byte is
checksummed once, a spooled file is checked by the CRC32Cs it is sent with, a slab is not
refilled while a request still reads it, and S3 requests are served in upload order."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from aiosnap import ChecksumMismatchError, Config, SyncCheckpointer
from aiosnap.core import checksums as checksums_module
from aiosnap.core.checksums import ALIGN, RangeChecksums, crc32c_combine
from aiosnap.storage.base import Storage
from aiosnap.storage.local import LocalStorage
from aiosnap.storage.s3 import _OrderedSlots
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import FaultyStorage, rot_after_writing, s3_config

MiB = 1024 * 1024

pytestmark = pytest.mark.both_servers  # the S3 ones: also against LocalStack, which checks the bytes


@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_combined_crc_is_the_crc_of_the_concatenation(first: bytes, second: bytes) -> None:
    assert crc32c_combine(crc32c.crc32c(first), crc32c.crc32c(second), len(second)) == crc32c.crc32c(first + second)


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(0, 3 * ALIGN + 5000),
    cuts=st.lists(st.integers(0, 3 * ALIGN + 5000), max_size=6),
    ends=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
def test_range_checksums_answer_any_range(size: int, cuts: list[int], ends: tuple[float, float]) -> None:
    data = memoryview(os.urandom(size))
    checksums = RangeChecksums(data, cuts)
    start, end = sorted(int(f * size) for f in ends)
    assert checksums.of(start, end) == crc32c.crc32c(data[start:end])
    assert checksums.of(0, size) == crc32c.crc32c(data)
    for cut in cuts:  # on a boundary: answered without the bytes
        if 0 <= cut <= size:
            checksums.release()
            assert checksums.of(0, cut) == crc32c.crc32c(data[:cut])
    with pytest.raises(ValueError, match="outside"):
        checksums.of(0, size + 1)


def test_each_byte_is_checksummed_once_on_its_way_to_s3(
    s3_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-tensor CRCs for the manifest and per-part CRCs for S3 come from one pass (the
    part CRCs are combined); S3 gets no SHA-256 of the body on top (UNSIGNED-PAYLOAD)."""
    counted = 0
    real = crc32c.crc32c

    def counting(data: Any, value: int = 0) -> int:
        nonlocal counted
        counted += memoryview(data).nbytes
        return int(real(data, value))

    state = {f"w{i}": torch.randn(3 * MiB // 4 + i) for i in range(8)}  # ~24 MiB, tensors across chunks
    nbytes = sum(t.numel() * 4 for t in state.values())
    with SyncCheckpointer(s3_config(s3_endpoint, s3_bucket)) as ckpt:  # 12 MiB chunks, 5 MiB parts
        monkeypatch.setattr(checksums_module.crc32c, "crc32c", counting)
        ckpt.save(state, step=1).wait(60)
        monkeypatch.setattr(checksums_module.crc32c, "crc32c", real)
        restored = ckpt.load()
    assert all(torch.equal(restored[k], v) for k, v in state.items())
    assert nbytes <= counted < nbytes + 64 * 1024, f"{counted} bytes checksummed for {nbytes} bytes of state"


@pytest.mark.parametrize("chunk_size", ["4MiB", "12MiB"], ids=["one-put", "multipart"])
def test_a_rotten_spool_file_never_becomes_an_object(
    s3_endpoint: str, s3_bucket: str, s3_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_size: str
) -> None:
    """The CRC32Cs S3 is sent, combined, check the file against the one it was written
    with: before the PUT, or before the multipart upload is completed (then aborted)."""
    rot_after_writing(monkeypatch, "1.bin")
    base = s3_config(s3_endpoint, s3_bucket)
    config = base.model_copy(
        update={
            "upload": base.upload.model_copy(
                update={"chunk_size": Config(upload={"chunk_size": chunk_size}).upload.chunk_size}
            ),
            "spool": type(base.spool).model_validate({"dir": str(tmp_path / "spool"), "mode": "always"}),
        }
    )
    ckpt = SyncCheckpointer(config)
    with pytest.raises(ChecksumMismatchError, match=r"spool file .*1\.bin is corrupt"):
        ckpt.save({"w": torch.randn(6 * MiB)}, step=1).wait(60)  # 24 MiB: several chunks
    ckpt.close()
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
    assert not any(k.endswith("/1.bin") for k in keys), keys
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


class _LingeringReader(FaultyStorage):
    """A storage whose "connection" still reads a body for a while after the write
    returned, as a closing socket's write buffer can: what it read at the end is kept."""

    def __init__(self, inner: Storage, linger: float) -> None:
        super().__init__(inner)
        self.linger = linger
        self.late_reads: list[tuple[str, int, int]] = []  # name, crc at write, crc read late
        self.tasks: set[asyncio.Task[None]] = set()

    async def write_checksummed(self, name: str, data: memoryview, checksums: RangeChecksums) -> None:
        held = data[:]  # what a transport keeps
        at_write = crc32c.crc32c(held)
        await self.inner.write(name, data)

        async def read_later() -> None:
            await asyncio.sleep(self.linger)
            self.late_reads.append((name, at_write, crc32c.crc32c(held)))
            held.release()

        task = asyncio.get_running_loop().create_task(read_later())
        self.tasks.add(task)


def test_a_slab_is_not_refilled_while_a_request_still_reads_it(root: Path) -> None:
    """One slab, two saves of different bytes: the second capture waits until the first
    save's lingering reader let go, so that reader only ever sees the first save's bytes."""
    storage = _LingeringReader(LocalStorage(root), linger=0.3)
    config = Config(storage={"url": str(root)}, ram_budget="1MiB", upload={"chunk_size": "1MiB"})
    with SyncCheckpointer(config, storage=storage) as ckpt:
        ckpt.save({"w": torch.full((200_000,), 1.0)}, step=1).wait(30)
        ckpt.save({"w": torch.full((200_000,), 2.0)}, step=2).wait(30)
        assert torch.equal(ckpt.load(step=1)["w"], torch.full((200_000,), 1.0))
    assert len(storage.late_reads) >= 2
    for name, at_write, late in storage.late_reads:
        assert late == at_write, f"{name}: the slab was refilled under a request still reading it"


async def test_requests_are_served_in_upload_order_and_cancelled_waiters_pass_their_slot() -> None:
    slots = _OrderedSlots(1)
    served: list[tuple[int, int]] = []
    release = asyncio.Event()

    async def request(priority: tuple[int, int]) -> None:
        async with slots.slot(priority):
            served.append(priority)
            await release.wait()

    first = asyncio.create_task(request((5, 0)))
    await asyncio.sleep(0)
    waiters = [asyncio.create_task(request(p)) for p in [(3, 1), (9, 0), (3, 0), (4, 0)]]
    await asyncio.sleep(0)
    waiters[3].cancel()  # (4, 0) gives up while waiting
    release.set()
    await asyncio.gather(first, *waiters[:3])
    assert served == [(5, 0), (3, 0), (3, 1), (9, 0)]
    async with asyncio.timeout(1):
        async with slots.slot((0, 0)):  # the slot count came back whole
            pass


@pytest.mark.parametrize("size", [MiB, 7 * MiB], ids=["put", "multipart"])
async def test_the_checking_server_refuses_bytes_that_do_not_match_their_crc(
    localstack_endpoint: str, size: int
) -> None:
    """The premise of running the suite against LocalStack: a body whose bytes are not
    the ones its CRC32C was computed over is refused (400 BadDigest), PUT and part alike."""
    import boto3
    from aiosnap import StorageError
    from aiosnap.config import S3Config
    from aiosnap.storage.s3 import S3Storage

    bucket = "checking-server"
    client = boto3.client("s3", endpoint_url=localstack_endpoint)
    client.create_bucket(Bucket=bucket)
    config = S3Config(endpoint_url=localstack_endpoint, addressing_style="path", multipart_threshold="6MiB",
                      part_size="5MiB", retry_deadline=5)  # fmt: skip
    storage = S3Storage(bucket, "p", config)
    data = memoryview(bytearray(os.urandom(size)))
    other = RangeChecksums(memoryview(bytes(size)))  # the CRCs of zeros, not of ``data``
    try:
        with pytest.raises(StorageError, match="BadDigest|InvalidRequest|XAmzContentChecksumMismatch"):
            await storage.write_checksummed("x.bin", data, other)
        await storage.write_checksummed("y.bin", data, RangeChecksums(data))
        assert await storage.read("y.bin") == bytes(data)
    finally:
        await storage.close()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert keys == ["p/y.bin"]
