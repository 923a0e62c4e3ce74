"""``upload.compression: zstd`` (issue 24): each tensor range compressed after a byte shuffle
by its dtype's item size, stored raw when that is not smaller, checksummed before and after,
decompressed on load into the target. Real files, real torch tensors, both executors;
hostile codec fields and corrupt frames are refused with typed errors, never a crash or an
allocation the range's size does not bound."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from aiosnap import Config, CorruptCheckpointError, ManifestError, SyncCheckpointer
from aiosnap.catalog.maintenance import verify_step
from aiosnap.core.checksums import crc32c_of
from aiosnap.core.names import step_dir
from aiosnap.format.manifest import COMPRESSED_VERSION, Manifest
from aiosnap.storage.base import Storage
from aiosnap.storage.local import LocalStorage
from tests.conftest import assert_same
from tests.fuzzing import sign_manifest

pytestmark = pytest.mark.both_executors

_DTYPES = [
    torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64,
]  # fmt: skip


def _config(root: Path, **upload: Any) -> Config:
    return Config(
        storage={"url": str(root)},
        ram_budget="4MiB",
        upload={"chunk_size": "256KiB", "concurrency": 4, "compression": "zstd", **upload},
        retention={"keep_last": None},
    )


def _trained_like(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values like a trained model's: small normal floats (their exponent bytes repeat)."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(numel, generator=g) * 0.02).to(dtype)
    if dtype == torch.bool:
        return torch.rand(numel, generator=g) > 0.9
    return torch.randint(-3, 4, (numel,), generator=g).to(dtype)


def _manifest(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / step_dir(step) / "manifest.json").read_text())


def test_every_dtype_and_odd_size_round_trips_compressed(root: Path) -> None:
    state: dict[str, Any] = {
        f"{str(dtype).removeprefix('torch.')}_{numel}": _trained_like(numel, dtype, i)
        for i, (dtype, numel) in enumerate((d, n) for d in _DTYPES for n in (1, 7, 4099, 70_001))
    }
    state["random"] = torch.randint(0, 256, (50_000,), dtype=torch.uint8)  # incompressible: stored raw
    state["matrix"] = _trained_like(300 * 301, torch.bfloat16, 99).reshape(300, 301)
    with SyncCheckpointer(_config(root)) as ckpt:
        ckpt.save(state, step=1).wait()
        assert_same(ckpt.load(step=1), state)
        partial = ckpt.load(step=1, paths=["bfloat16_70001", "matrix"])
        assert_same(partial, {"bfloat16_70001": state["bfloat16_70001"], "matrix": state["matrix"]})
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        ckpt.load(target)  # in place, into the caller's tensors
        assert_same(target, state)
        manifest = ckpt.manifest(1)
        assert verify_step_sync(ckpt, manifest) == []
    assert manifest.format_version == COMPRESSED_VERSION
    codecs = {e.path: [r for r in e.ranges] for e in manifest.entries}
    assert all(r.codec is None for r in codecs["random"])  # not smaller: stored raw
    bf16 = codecs["bfloat16_70001"]
    assert all(r.codec == "zstd" and r.shuffle == 2 for r in bf16)
    assert sum(r.stored or r.nbytes for r in bf16) <= 0.8 * state["bfloat16_70001"].nbytes
    f32 = codecs["float32_70001"]  # 23 random mantissa bits of 32: no lossless codec gets far below 0.84
    assert all(r.shuffle == 4 for r in f32) and sum(r.stored or 0 for r in f32) <= 0.9 * 70_001 * 4
    raw = sum(t.nbytes for t in state.values())
    assert manifest.own_bytes < 0.8 * raw


def verify_step_sync(ckpt: SyncCheckpointer, manifest: Manifest) -> list[str]:
    import asyncio

    async def run() -> list[str]:
        storage = LocalStorage(ckpt.url)
        try:
            return await verify_step(storage, manifest)
        finally:
            await storage.close()

    return asyncio.run(run())


def test_compressed_and_incremental_saves_reuse_compressed_ranges(root: Path) -> None:
    state = {"frozen": _trained_like(200_000, torch.bfloat16, 1), "adapter": _trained_like(100, torch.float32, 2)}
    with SyncCheckpointer(_config(root, dedup=True)) as ckpt:
        ckpt.save(state, step=1).wait()
        state["adapter"].add_(1)
        ckpt.save(state, step=2).wait()
        assert_same(ckpt.load(step=2), state)
        first, second = ckpt.manifest(1), ckpt.manifest(2)
    frozen = {e.path: e for e in second.entries}["frozen"]
    assert all(r.codec == "zstd" for r in frozen.ranges)
    assert {r.object for r in frozen.ranges} <= {o.name for o in first.objects}
    assert second.own_bytes < 1000


@pytest.mark.thread_only
def test_a_spooled_compressed_save_round_trips(tmp_path: Path) -> None:
    config = _config(tmp_path / "ckpt").model_copy(
        update={"spool": Config(spool={"dir": str(tmp_path / "spool"), "mode": "always"}).spool}
    )
    state = {"w": _trained_like(150_000, torch.float16, 3), "n": 4}
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(state, step=1).wait()
        assert_same(ckpt.load(step=1), state)
        assert any(r.codec for e in ckpt.manifest(1).entries for r in e.ranges)


def _saved(root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    state = {"w": _trained_like(60_000, torch.bfloat16, 5)}
    with SyncCheckpointer(_config(root)) as ckpt:
        ckpt.save(state, step=1).wait()
    return state, _manifest(root, 1)


def _first_range(doc: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = doc["entries"][0]["ranges"][0]
    assert found["codec"] == "zstd"
    return found


@pytest.mark.thread_only
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r.pop("stored"), "needs stored"),
        (lambda r: r.pop("stored_crc32c"), "needs stored"),
        (lambda r: r.update(stored=r["nbytes"]), "not smaller"),
        (lambda r: r.update(stored=0), "stored"),
        (lambda r: r.update(shuffle=7), "cannot be shuffled"),
        (lambda r: r.update(shuffle=1), "shuffle"),
        (lambda r: r.update(codec="lz4"), "codec"),
        (lambda r: r.update(codec=None), "no codec"),
        (lambda r: r.update(stored_crc32c=2**32), "stored_crc32c"),
        (lambda r: r.update(stored=r["nbytes"] - 1, offset=10**9), "runs past the end"),
    ],
)
def test_hostile_codec_fields_are_manifest_errors(root: Path, edit: Any, message: str) -> None:
    _, doc = _saved(root)
    edit(_first_range(doc))
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(sign_manifest(doc), "m")


@pytest.mark.thread_only
def test_a_compressed_range_in_an_older_format_version_is_refused(root: Path) -> None:
    _, doc = _saved(root)
    doc["format_version"] = 4
    with pytest.raises(ManifestError, match="no compressed ranges"):
        Manifest.from_json(sign_manifest(doc), "m")


@pytest.mark.thread_only
def test_a_corrupt_frame_is_a_checksum_error(root: Path) -> None:
    _, doc = _saved(root)
    r = _first_range(doc)
    path = root / r["object"]
    data = bytearray(path.read_bytes())
    data[r["offset"] + r["stored"] // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with SyncCheckpointer(_config(root)) as ckpt, pytest.raises(CorruptCheckpointError, match="compressed bytes"):
        ckpt.load(step=1)


def _forge_frame(root: Path, doc: dict[str, Any], frame: bytes) -> None:
    """Put ``frame`` where the first range's frame is, with a matching stored crc32c (what a
    person who may write the storage can do), and sign the manifest."""
    r = _first_range(doc)
    assert len(frame) < r["stored"] + 1, "the forged frame must fit where the old one was"
    path = root / r["object"]
    data = bytearray(path.read_bytes())
    data[r["offset"] : r["offset"] + len(frame)] = frame
    path.write_bytes(bytes(data))
    r["stored"], r["stored_crc32c"] = len(frame), crc32c_of(frame)
    (root / step_dir(1) / "manifest.json").write_bytes(sign_manifest(doc))


@pytest.mark.thread_only
@pytest.mark.parametrize("kind", ["bomb", "short", "garbage", "window", "unsized"])
def test_a_forged_frame_is_refused_without_a_large_allocation(root: Path, kind: str) -> None:
    """Also before anything is decompressed: the frame's header must say it holds the
    range's size (a frame that does not say, "unsized", is refused by its header)."""
    _, doc = _saved(root)
    nbytes = _first_range(doc)["nbytes"]
    frames = {
        "bomb": zstandard.ZstdCompressor(level=19).compress(bytes(512 * 1024**2)),  # 512 MiB of zeros, a few KiB
        "short": zstandard.ZstdCompressor().compress(bytes(nbytes // 2)),
        "garbage": b"\x28\xb5\x2f\xfd" + bytes(range(200)),
        "window": zstandard.ZstdCompressor(
            compression_params=zstandard.ZstdCompressionParameters(window_log=31, enable_ldm=True)
        ).compress(bytes(1000)),
        "unsized": zstandard.ZstdCompressor(write_content_size=False).compress(bytes(nbytes)),
    }
    frame = frames[kind]
    _forge_frame(root, doc, frame)
    with SyncCheckpointer(_config(root)) as ckpt, pytest.raises(CorruptCheckpointError, match="decompress") as got:
        ckpt.load(step=1)
    if kind in ("unsized", "short", "bomb"):
        assert "header says" in str(got.value)


def test_bf16_weights_compress_to_0_8_and_fp32_adam_moments_below_0_9(root: Path) -> None:
    """bf16 (7 mantissa bits of 16) compresses to about 0.7 of its bytes; fp32 (23 of 32,
    random in trained values) to about 0.85: the exponent bytes compress, the mantissa
    bytes cannot (measured: 0.71 and 0.85 of their bytes)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        optim.zero_grad()
        model(torch.randn(16, 256)).square().mean().backward()
        optim.step()
    state = {"bf16": {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, "optim": optim}
    with SyncCheckpointer(_config(root)) as ckpt:
        ckpt.save(state, step=1).wait()
        manifest = ckpt.manifest(1)
        loaded = ckpt.load(step=1)
    assert_same(loaded["bf16"], state["bf16"])
    for prefix, ratio in (("bf16/", 0.8), ("optim/state/", 0.9)):
        ranges = [r for e in manifest.entries if e.path.startswith(prefix) for r in e.ranges]
        raw = sum(r.nbytes for r in ranges)
        stored = sum(r.extent for r in ranges)
        assert stored <= ratio * raw, (prefix, stored / raw)
    assert math.isfinite(manifest.own_bytes)


@pytest.mark.thread_only
def test_the_safetensors_export_reads_compressed_ranges(root: Path, tmp_path: Path) -> None:
    import aiosnap
    from safetensors.torch import load_file

    state = {"model": {"w": _trained_like(200_001, torch.bfloat16, 8), "b": _trained_like(77, torch.float32, 9)}}
    with SyncCheckpointer(_config(root)) as ckpt:
        ckpt.save(state, step=1).wait()
    out = tmp_path / "hf"
    aiosnap.export(str(root), str(out), to="safetensors")
    found: dict[str, torch.Tensor] = {}
    for shard in out.glob("*.safetensors"):
        found.update(load_file(str(shard)))
    assert sorted(found) == ["b", "w"]
    for name in found:
        assert_same(found[name], state["model"][name])


def test_packing_never_writes_the_slab_and_lands_whole_when_its_ram_is_short(tmp_path: Path) -> None:
    """A staged slab may be read by another party while it uploads (on preemption the
    trainer side writes it to the spool, and journals its bytes at the plan's offsets), so
    packing and compressing write into RAM of their own, reserved without waiting from the
    transfer side's share of the budget: the slab is byte for byte what was captured
    afterwards, the reservation is given back (also when the write fails), and with no room
    the chunk lands whole and raw (correct, only larger)."""
    import asyncio

    from aiosnap.core.budget import ByteBudget
    from aiosnap.format.spec import ChunkSpec, PieceSpec
    from aiosnap.transfer.dedup import land_slab
    from tests.conftest import FaultyStorage

    parts = [_trained_like(30_000, torch.float32, seed).view(torch.uint8) for seed in range(3)]
    pieces = tuple(PieceSpec(i, p.numel(), 120_064 * i) for i, p in enumerate(parts))
    chunk = ChunkSpec("1/s/rank-0/0.bin", 120_064 * 2 + parts[2].numel(), pieces)
    slab = bytearray(chunk.nbytes)
    for piece, part in zip(pieces, parts, strict=True):
        slab[piece.dst_offset : piece.dst_offset + piece.nbytes] = part.numpy().tobytes()
    captured = bytes(slab)
    storage = LocalStorage(tmp_path)

    async def land(scratch: ByteBudget, target: Storage = storage) -> Any:
        return await land_slab(target, memoryview(slab), chunk, None, [4, 4, 4], scratch)

    scratch = ByteBudget(1 << 20, "packing scratch")
    packed = asyncio.run(land(scratch))
    assert bytes(slab) == captured and scratch.used == 0
    assert all(p.stored is not None and p.shuffle == 4 for p in packed.pieces)
    assert (tmp_path / chunk.object_name).stat().st_size == packed.stored < 0.95 * chunk.nbytes

    failing = FaultyStorage(storage, fail_when=lambda name: True, error=OSError("disk full"))
    with pytest.raises(OSError, match="disk full"):
        asyncio.run(land(scratch, failing))
    assert scratch.used == 0 and bytes(slab) == captured

    full = ByteBudget(1 << 20, "packing scratch")
    assert full.try_acquire(full.capacity - 1000)
    whole = asyncio.run(land(full))
    assert full.used == full.capacity - 1000
    assert whole.stored == chunk.nbytes and all(p.stored is None for p in whole.pieces)
    assert [p.offset for p in whole.pieces] == [p.dst_offset for p in pieces]
    assert (tmp_path / chunk.object_name).read_bytes() == captured


@pytest.mark.parametrize(
    ("dtype", "ram_budget", "fits"),
    [(torch.bfloat16, "4MiB", False), (torch.int8, "4MiB", True), (torch.bfloat16, "16MiB", True)],
)
def test_a_safetensors_export_of_a_compressed_range_larger_than_half_its_budget(
    root: Path, tmp_path: Path, dtype: torch.dtype, ram_budget: str, fits: bool
) -> None:
    """The export's range cache streams a range above half its budget in raw windows: a
    compressed range's raw bytes are not at those offsets (it once exported frame bytes as
    the tensor). A compressed range is read whole through the decompressing reader, its
    frame and raw bytes charged: the export is bit-exact when they fit,
    and refused naming ram_budget when they do not, never wrong."""
    import aiosnap
    from aiosnap import AiosnapError
    from safetensors.torch import load_file

    w = _trained_like(2_800_000 // dtype.itemsize, dtype, 5)  # 2.8 MB in one compressed range
    upload = {"chunk_size": "4MiB", "compression": "zstd"}
    config = Config(storage={"url": str(root)}, ram_budget="16MiB", upload=upload)
    with SyncCheckpointer(config) as ckpt:
        ckpt.save({"model": {"w": w}}, step=1).wait()
        assert all(r.codec == "zstd" for e in ckpt.manifest(1).entries for r in e.ranges)
    out = tmp_path / "hf"
    if not fits:  # 4 MiB for source ranges: 2.8 MB raw + its ~2 MB frame do not fit
        with pytest.raises(AiosnapError, match="ram_budget"):
            aiosnap.export(str(root), str(out), to="safetensors", config={"ram_budget": ram_budget})
        return
    aiosnap.export(str(root), str(out), to="safetensors", config={"ram_budget": ram_budget})
    found: dict[str, torch.Tensor] = {}
    for shard in out.glob("*.safetensors"):
        found.update(load_file(str(shard)))
    assert torch.equal(found["w"].view(torch.uint8), w.view(torch.uint8))


@pytest.mark.thread_only  # tracemalloc sees this process's allocations
def test_a_compressed_range_is_decompressed_into_its_tensor_without_a_second_copy(root: Path) -> None:
    """A load holds the stored frame and a 64 KiB unshuffle scratch, never a second buffer
    of the range's raw size (Python's allocator is traced; the tensors are torch's)."""
    import tracemalloc

    w = _trained_like(4_000_000, torch.bfloat16, 6)  # 8 MB in one compressed range
    config = Config(storage={"url": str(root)}, ram_budget="64MiB", upload={"compression": "zstd"})
    with SyncCheckpointer(config) as ckpt:
        ckpt.save({"w": w}, step=1).wait()
        (stored,) = ckpt.manifest(1).entries[0].ranges
        assert stored.codec == "zstd" and stored.extent < 0.9 * stored.nbytes
        tracemalloc.start()
        try:
            loaded = ckpt.load(step=1)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert torch.equal(loaded["w"].view(torch.uint8), w.view(torch.uint8))
    assert peak < stored.extent + stored.nbytes // 4, (peak, stored.extent, stored.nbytes)
