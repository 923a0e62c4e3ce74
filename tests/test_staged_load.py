"""Loads through staging slabs (issue 12): targets that cannot take a direct read (strided
views here; CUDA tensors in tests/test_gpu.py) are loaded in place a slab at a time, each
range verified before any byte reaches them, in the RAM budget."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import Checkpointer, ChecksumMismatchError, Config, SyncCheckpointer
from aiosnap.checksums import crc32c_of
from aiosnap.format.manifest import Manifest
from aiosnap.load import fetch
from aiosnap.load.staged import stageable
from aiosnap.names import manifest_name
from aiosnap.storage.local import LocalStorage
from tests.conftest import damage_entry

MiB = 1024 * 1024


def _fresh_tensors(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The entries a load reads into tensors of its own (rather than the caller's)."""
    made: list[str] = []
    real = fetch._empty_for

    def counting(manifest: Any, index: int) -> torch.Tensor:
        made.append(manifest.entries[index].path)
        return real(manifest, index)

    monkeypatch.setattr(fetch, "_empty_for", counting)
    return made


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
        made = _fresh_tensors(monkeypatch)
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
    made = _fresh_tensors(monkeypatch)
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


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_a_staged_load_ten_times_the_budget_stays_within_budget(tmp_path: Path) -> None:
    budget_mib = 16
    out = subprocess.run(
        [sys.executable, "-m", "tests.memory_probe", str(tmp_path), str(budget_mib), "staged-load"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    print(figures)
    assert figures["values_equal"] and figures["state_bytes"] >= 10 * figures["budget"]
    assert figures["rss_increase"] <= figures["budget"] + 64 * MiB, figures
