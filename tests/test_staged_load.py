"""Loads through staging slabs (issue 12): targets that cannot take a direct read (strided
views here; CUDA tensors in tests/test_gpu.py) are loaded in place a slab at a time, each
range verified before any byte reaches them, in the RAM budget."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import Checkpointer, ChecksumMismatchError, Config, SyncCheckpointer
from aiosnap.core.checksums import crc32c_of
from aiosnap.core.names import manifest_name
from aiosnap.format.manifest import Manifest
from aiosnap.load.staged import stageable
from aiosnap.storage.local import LocalStorage
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import count_fresh_tensors, damage_entry
from tests.memory_probe import SLACK, needs_peak_rss, run_probe

MiB = 1024 * 1024


def _strided(rows: int, columns: int, fill: float = 0.0) -> torch.Tensor:
    """A (columns, rows) view of a (rows, columns) tensor: not contiguous."""
    return torch.full((rows, columns), fill).t()


def _config(root: Path, **extra: Any) -> Config:
    return Config(storage={"url": str(root)}, events={"log": False}, **extra)


def test_a_strided_target_is_loaded_in_place_through_slabs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    saved = {"w": torch.randn(300, 200, generator=g).t(), "b": torch.randn(50, generator=g)[::2]}
    with SyncCheckpointer(_config(tmp_path, ram_budget="1MiB", upload={"chunk_size": "128KiB"})) as ckpt:
        ckpt.save(saved, step=1).wait()
        w, b = _strided(300, 200), torch.zeros(50)[::2]
        addresses = (w.data_ptr(), b.data_ptr())
        made = count_fresh_tensors(monkeypatch)
        state = {"w": w, "b": b}
        ckpt.load(state)
        assert ckpt._engine.budget.high_water <= ckpt._engine.budget.capacity
    assert made == [], f"fresh tensors made for {made}"
    assert state["w"] is w and state["b"] is b and (w.data_ptr(), b.data_ptr()) == addresses
    assert torch.equal(w, saved["w"]) and torch.equal(b, saved["b"])


def test_a_damaged_range_never_reaches_its_staged_target(tmp_path: Path) -> None:
    config = _config(tmp_path, upload={"chunk_size": "64KiB"})
    with SyncCheckpointer(config) as ckpt:
        ckpt.save({"w": torch.arange(1000.0).reshape(50, 20).t(), "ok": torch.ones(10, 10).t()}, step=1).wait()
    damage_entry(config, "w", at=100, mask=0x10)
    w, ok = _strided(50, 20, fill=-1.0), _strided(10, 10)
    with SyncCheckpointer(config) as ckpt, pytest.raises(ChecksumMismatchError) as caught:
        ckpt.load({"w": w, "ok": ok})
    assert "'w'" in str(caught.value) and "partly loaded" in str(caught.value)
    assert torch.equal(w, _strided(50, 20, fill=-1.0)), "bytes that failed their check were copied"


def test_ranges_larger_than_a_slab_are_read_into_a_tensor_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = torch.randn(512, 1024).t()  # 2 MiB in one range
    with SyncCheckpointer(_config(tmp_path, upload={"chunk_size": "4MiB"})) as ckpt:
        ckpt.save({"big": big, "small": torch.ones(8, 8).t()}, step=1).wait()
    made = count_fresh_tensors(monkeypatch)
    target, small = _strided(512, 1024), _strided(8, 8)
    with SyncCheckpointer(_config(tmp_path, ram_budget="1MiB", upload={"chunk_size": "256KiB"})) as ckpt:
        ckpt.load({"big": target, "small": small})
    assert made == ["big"]
    assert torch.equal(target, big) and torch.equal(small, torch.ones(8, 8))


def test_a_forged_range_that_cuts_an_element_is_never_staged(tmp_path: Path) -> None:
    """A hand-edited manifest may split an entry's bytes mid-element (each range with a
    right crc): the entry is then read whole into a tensor of its own and copied."""
    values = torch.arange(8.0).reshape(2, 4)
    with SyncCheckpointer(_config(tmp_path)) as ckpt:
        ckpt.save({"w": values.t()}, step=1).wait()
        manifest = ckpt.manifest()
    entry = manifest.entries[0]
    (whole,) = entry.ranges
    data = (tmp_path / whole.object).read_bytes()[whole.offset : whole.offset + whole.nbytes]
    doc = json.loads(manifest.to_json())
    doc.pop("crc32c")
    doc["entries"][0]["ranges"] = [
        {"object": whole.object, "offset": whole.offset, "nbytes": 6, "crc32c": crc32c_of(data[:6])},
        {"object": whole.object, "offset": whole.offset + 6, "nbytes": whole.nbytes - 6, "crc32c": crc32c_of(data[6:])},
    ]
    forged = Manifest.model_validate(doc)
    assert not stageable(forged, 0, 1 * MiB) and stageable(manifest, 0, 1 * MiB)
    (tmp_path / manifest_name(1)).write_bytes(forged.to_json())
    target = _strided(2, 4)
    with SyncCheckpointer(_config(tmp_path)) as ckpt:
        ckpt.load({"w": target})
    assert torch.equal(target, values.t())


class _SlowReads(LocalStorage):
    """Local storage whose reads each take a while (a slow disk or network)."""

    async def read_scatter(self, name: str, offset: int, buffers: Sequence[memoryview]) -> int:
        await asyncio.sleep(0.05)
        return await super().read_scatter(name, offset, buffers)


def test_a_cancelled_staged_load_gives_back_every_slab(tmp_path: Path) -> None:
    saved = {f"w{i}": torch.full((64, 256), float(i)).t() for i in range(24)}  # 64 KiB each

    async def scenario() -> None:
        config = _config(tmp_path, ram_budget="256KiB", upload={"chunk_size": "64KiB"})
        async with Checkpointer(config, storage=_SlowReads(tmp_path)) as ckpt:
            await (await ckpt.save(saved, step=1))
            pool = ckpt._engine.pool
            assert pool is not None
            slabs = pool.arena.count
            targets = {name: _strided(64, 256) for name in saved}
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(ckpt.load(targets), 0.12)
            await asyncio.sleep(0.3)  # reads under way when cancelled end first
            assert pool._free.qsize() == slabs and ckpt._engine.budget.used == 0
            await ckpt.load(targets)
            for name, tensor in saved.items():
                assert torch.equal(targets[name], tensor), name
            await (await ckpt.save(saved, step=2))  # the slabs serve saves again

    asyncio.run(scenario())


@needs_peak_rss
def test_a_staged_load_ten_times_the_budget_stays_within_budget(tmp_path: Path) -> None:
    figures = run_probe(tmp_path, 16, "staged-load")
    assert figures["values_equal"] and figures["state_bytes"] >= 10 * figures["budget"]
    assert figures["rss_increase"] <= figures["budget"] + SLACK, figures


class _CountingReads(LocalStorage):
    """Local storage that counts the bytes each read asks for."""

    requested = 0

    async def read_scatter(self, name: str, offset: int, buffers: Sequence[memoryview]) -> int:
        type(self).requested += sum(b.nbytes for b in buffers)
        return await super().read_scatter(name, offset, buffers)


def _reshard_into_box(
    root: Path, slab_bytes: int, offsets: tuple[int, int], shape: tuple[int, int]
) -> tuple[torch.Tensor, int, int, int]:
    """Read box (``offsets``, ``shape``) of the saved 2-D ``w`` into a target through a pool
    of two ``slab_bytes`` slabs: the target, the Python allocation peak, the budget's
    high-water mark, and the bytes read."""
    import tracemalloc

    from aiosnap.catalog.steps import read_manifest
    from aiosnap.core.arena import Arena
    from aiosnap.core.budget import ByteBudget
    from aiosnap.load.reshard import ShardTarget, overlaps, read_into_targets
    from aiosnap.trainer.slabs import LoadSlabs, SlabPool

    dest = torch.zeros(shape)
    _CountingReads.requested = 0

    async def scenario() -> tuple[int, int]:
        storage = _CountingReads(root)
        manifest = await read_manifest(storage, 1)
        arena = Arena(slab_bytes, 2, shared=False)
        budget = ByteBudget(arena.size)
        pool = SlabPool(arena, budget)
        try:
            items = overlaps(manifest, {0: ShardTarget(dest, offsets, shape, dest)})
            tracemalloc.start()
            try:
                await read_into_targets(storage, "test", items, asyncio.Semaphore(4), LoadSlabs(pool))
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert pool._free.qsize() == arena.count and budget.used == 0
            return peak, budget.high_water
        finally:
            arena.close()

    peak, high_water = asyncio.run(scenario())
    return dest, peak, high_water, _CountingReads.requested


def _save_w(root: Path, values: torch.Tensor) -> None:
    with SyncCheckpointer(_config(root, upload={"chunk_size": "64KiB"})) as ckpt:
        ckpt.save({"w": values}, step=1).wait()


@pytest.mark.parametrize(
    ("shape", "offsets", "box"),
    [
        ((256, 1000), (0, 300), (256, 100)),  # a column block: rows cross the 64 KiB chunks anywhere
        ((3000, 250), (1000, 0), (1000, 250)),  # rank 1 of 3, Shard(0), from one stored shard
        ((256, 1024), (7, 5), (200, 1000)),
    ],
)
def test_a_reshard_copy_goes_through_slabs_reading_each_range_once(
    tmp_path: Path, shape: tuple[int, int], offsets: tuple[int, int], box: tuple[int, int]
) -> None:
    """A target box that is not one stretch of a stored shard (a column block, as Shard(1)
    resharding gives; rows of a shard saved on other ranks) is read a slab of stored ranges
    at a time (slabs the size of the stored chunks, as the checkpointer makes them), each
    range once, not into a buffer as large as the stored span."""
    values = torch.randn(shape)
    _save_w(tmp_path, values)
    dest, peak, high_water, read = _reshard_into_box(tmp_path, 64 * 1024, offsets, box)
    (r0, c0), (rows, columns) = offsets, box
    assert torch.equal(dest, values[r0 : r0 + rows, c0 : c0 + columns])
    assert 0 < high_water <= 2 * 64 * 1024
    assert peak < 64 * 1024, f"{peak} bytes allocated: the span went through a buffer of its own"
    first, last = (r0 * shape[1] + c0) * 4, ((r0 + rows - 1) * shape[1] + c0 + columns) * 4
    chunk = 64 * 1024
    assert read <= (last // chunk - first // chunk + 1) * chunk  # each chunk the box touches, once


def test_a_reshard_range_larger_than_a_slab_reads_the_span_in_one_piece(tmp_path: Path) -> None:
    values = torch.randn(256, 1024)
    _save_w(tmp_path, values)
    dest, _, high_water, _ = _reshard_into_box(tmp_path, 32 * 1024, (0, 10), (256, 10))  # 64 KiB ranges
    assert torch.equal(dest, values[:, 10:20]) and high_water == 0


@pytest.mark.parametrize(("cut", "staged"), [(4100, True), (4099, False)])
def test_a_reshard_through_slabs_and_forged_range_boundaries(tmp_path: Path, cut: int, staged: bool) -> None:
    """A forged manifest (valid checksums) cutting each stored range in two: at an element
    boundary the slabs still serve; mid-element, the overlap is read in one piece."""
    from tests.fuzzing import sign_manifest

    values = torch.randn(256, 1000)
    _save_w(tmp_path, values)
    path = tmp_path / manifest_name(1)
    doc = json.loads(path.read_bytes())
    split = []
    for r in doc["entries"][0]["ranges"]:
        data = (tmp_path / r["object"]).read_bytes()[r["offset"] : r["offset"] + r["nbytes"]]
        for a, b in ((0, cut), (cut, r["nbytes"])):
            crc = crc32c_of(data[a:b])
            split.append({"object": r["object"], "offset": r["offset"] + a, "nbytes": b - a, "crc32c": crc})
    doc["entries"][0]["ranges"] = split
    path.write_bytes(sign_manifest(doc))
    dest, _, high_water, _ = _reshard_into_box(tmp_path, 64 * 1024, (3, 5), (250, 990))
    assert torch.equal(dest, values[3:253, 5:995])
    assert (high_water > 0) == staged


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_box_pieces_are_exactly_the_box_elements_in_an_interval(data: st.DataObject) -> None:
    from aiosnap.load.reshard import box_pieces

    ndim = data.draw(st.integers(0, 4))
    stored = [data.draw(st.integers(1, 5)) for _ in range(ndim)]
    box_start = [data.draw(st.integers(0, n - 1)) for n in stored]
    box_shape = [data.draw(st.integers(1, n - s)) for n, s in zip(stored, box_start, strict=True)]
    strides = [1] * ndim
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * stored[d + 1]
    total = max(1, strides[0] * stored[0]) if ndim else 1
    a = data.draw(st.integers(0, total))
    b = data.draw(st.integers(a, total))
    first = sum(s * st_ for s, st_ in zip(box_start, strides, strict=True))
    want = {
        index
        for index in itertools.product(*(range(n) for n in box_shape))
        if a <= first + sum(i * st_ for i, st_ in zip(index, strides, strict=True)) < b
    }
    got: list[tuple[int, ...]] = []
    for start, shape in box_pieces(first, tuple(box_shape), strides, a, b):
        got.extend(
            tuple(o + i for o, i in zip(start, index, strict=True))
            for index in itertools.product(*(range(n) for n in shape))
        )
    assert sorted(got) == sorted(want) and len(got) == len(set(got))
    assert len(box_pieces(first, tuple(box_shape), strides, a, b)) <= 2 * ndim + 1


def test_a_cancelled_reshard_through_slabs_gives_back_every_slab(tmp_path: Path) -> None:
    """Cancelled at any await (a slab, a read, a check, a copy), a reshard leaves no slab
    lent out and nothing counted in the budget; the checkpoint is untouched and loads."""
    from aiosnap.catalog.steps import read_manifest
    from aiosnap.core.arena import Arena
    from aiosnap.core.budget import ByteBudget
    from aiosnap.load.reshard import ShardTarget, overlaps, read_into_targets
    from aiosnap.trainer.slabs import LoadSlabs, SlabPool

    values = torch.randn(256, 1000)
    _save_w(tmp_path, values)

    async def scenario(delay: float) -> None:
        storage = _SlowReads(tmp_path)
        manifest = await read_manifest(storage, 1)
        arena = Arena(64 * 1024, 2, shared=False)
        budget = ByteBudget(arena.size)
        pool = SlabPool(arena, budget)
        try:
            dest = torch.zeros(256, 100)
            items = overlaps(manifest, {0: ShardTarget(dest, (0, 300), (256, 100), dest)})
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(
                    read_into_targets(storage, "test", items, asyncio.Semaphore(2), LoadSlabs(pool)), delay
                )
            assert pool._free.qsize() == arena.count and budget.used == 0
            await read_into_targets(storage, "test", items, asyncio.Semaphore(2), LoadSlabs(pool))
            assert torch.equal(dest, values[:, 300:400])
        finally:
            arena.close()

    for delay in (0.001, 0.03, 0.07, 0.12):
        asyncio.run(scenario(delay))
