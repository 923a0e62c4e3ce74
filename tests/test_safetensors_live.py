"""Live export at save time: ``save(..., also_as="safetensors")`` writes the Hugging Face layout
of the state's tensors from the same capture, in the background, into the save's own folder,
committed with the step (there whole exactly when the step is), removed by retention with it;
a failure of the export fails the save before its commit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import SyncCheckpointer
from aiosnap.interop.safetensors.layout import INDEX_FILE
from aiosnap.interop.safetensors.live import SafetensorsExport, live_export_folder
from aiosnap.storage.local import LocalStorage
from safetensors.torch import load, load_file
from tests.conftest import FaultyStorage, s3_config

pytestmark = pytest.mark.both_executors


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(4)
    net = torch.nn.Sequential(torch.nn.Linear(512, 384), torch.nn.LayerNorm(384), torch.nn.Linear(384, 64))
    return net.to(dtype)


def _config(root: Path, **extra: Any) -> dict[str, Any]:
    return {"storage": {"url": str(root)}, "upload": {"chunk_size": "128KiB"}, "ram_budget": "2MiB", **extra}


def _exported(folder: Path) -> dict[str, torch.Tensor]:
    weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    found: dict[str, torch.Tensor] = {}
    for file in set(weight_map.values()):
        found.update(load_file(folder / file))
    return found


def test_a_save_also_writes_its_safetensors_committed_with_the_step(tmp_path: Path) -> None:
    net = _model()
    net[1].to(torch.bfloat16)  # mixed dtypes, in capture order (unaligned tensors are fine for the library)
    root = tmp_path / "ckpt"
    with SyncCheckpointer(_config(root, retention={"keep_last": 1})) as ckpt:
        request = SafetensorsExport(paths=["model/*"], max_shard_size="300KB", metadata={"run": "7"})
        ckpt.save({"model": net, "optim": {"lr": torch.tensor(0.1)}}, step=1, also_as=request).wait()
        manifest = ckpt.manifest()
        folder = root / live_export_folder(1, manifest.save_id)
        tensors = _exported(folder)
        assert set(tensors) == set(net.state_dict())
        for name, value in net.state_dict().items():
            assert torch.equal(tensors[name], value), name
        assert len(list(folder.glob("model-*.safetensors"))) >= 2
        assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary file left
        loaded = ckpt.load()  # the checkpoint itself is untouched by the export
        assert torch.equal(loaded["model"]["0.weight"], net.state_dict()["0.weight"])
        ckpt.save({"model": net, "optim": {"lr": torch.tensor(0.2)}}, step=2, also_as="safetensors").wait()
        assert ckpt.steps() == [2]
    assert not folder.exists()  # retention removed step 1 and its export with it
    again = _exported(root / live_export_folder(2, _save_id_of(root, 2)))
    assert "optim.lr" in again and "0.weight" in again  # the default: every tensor


def _save_id_of(root: Path, step: int) -> str:
    with SyncCheckpointer(_config(root)) as ckpt:
        return ckpt.manifest(step).save_id


@pytest.mark.thread_only
def test_a_failing_export_fails_the_save_before_its_commit(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    net = _model()
    storage = FaultyStorage(LocalStorage(root))
    with SyncCheckpointer(_config(root), storage=storage) as ckpt:
        ckpt.save({"model": net}, step=1, also_as="safetensors").wait()
        storage.fail_when = lambda what: what.endswith("#part1")
        storage.error = OSError(5, "Input/output error")
        with pytest.raises(OSError, match="Input/output error") as caught:
            ckpt.save({"model": net}, step=2, also_as="safetensors").wait()
        assert type(caught.value) is OSError
        assert ckpt.steps() == [1]  # the previous step stands, and loads
        assert torch.equal(ckpt.load()["model"]["0.weight"], net.state_dict()["0.weight"])


@pytest.mark.thread_only  # refused on the caller's thread: the executor plays no part
def test_what_a_live_export_cannot_do_is_refused_in_save(tmp_path: Path) -> None:
    with SyncCheckpointer(_config(tmp_path / "ckpt")) as ckpt:
        with pytest.raises(ValueError, match="no tensor"):
            ckpt.save({"model": _model()}, step=1, also_as=SafetensorsExport(paths=["nothing/*"]))
        with pytest.raises(ValueError, match="cannot hold complex128"):
            ckpt.save({"z": torch.zeros(2, dtype=torch.complex128)}, step=1, also_as="safetensors")
        with pytest.raises(ValueError, match="also_as="):
            ckpt.save({"model": _model()}, step=1, also_as="gguf")
        assert ckpt.steps() == []
    target = tmp_path / "one.ckpt"
    target.touch()
    with SyncCheckpointer(_config(target)) as ckpt, pytest.raises(ValueError, match="single-file"):
        ckpt.save({"model": _model()}, step=1, also_as="safetensors")


@pytest.mark.thread_only  # the upload process runs the same part uploads (the local test covers it)
def test_a_live_export_to_s3(tmp_path: Path, s3_endpoint: str, s3_bucket: str, s3_client: Any) -> None:
    net = _model()
    generator = torch.Generator().manual_seed(1)
    state = {"model": net, "big": {"table": torch.randn(3000, 1024, generator=generator)}}  # 12 MB: several parts
    with SyncCheckpointer(s3_config(s3_endpoint, s3_bucket)) as ckpt:
        ckpt.save(state, step=3, also_as="safetensors").wait()
        save_id = ckpt.manifest().save_id
    prefix = f"run/{live_export_folder(3, save_id)}/"
    listed = s3_client.list_objects_v2(Bucket=s3_bucket, Prefix=prefix)["Contents"]
    objects = {
        o["Key"][len(prefix) :]: s3_client.get_object(Bucket=s3_bucket, Key=o["Key"])["Body"].read() for o in listed
    }
    found: dict[str, torch.Tensor] = {}
    for file in set(json.loads(objects[INDEX_FILE])["weight_map"].values()):
        found.update(load(objects[file]))
    assert torch.equal(found["big.table"], state["big"]["table"])
    assert torch.equal(found["2.weight"], net.state_dict()["2.weight"])
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_chunks_that_went_through_the_spool_are_exported_too(tmp_path: Path) -> None:
    net = _model()
    root = tmp_path / "ckpt"
    config = _config(root, spool={"dir": str(tmp_path / "spool"), "mode": "always"})
    with SyncCheckpointer(config) as ckpt:
        result = ckpt.save({"model": net}, step=1, also_as="safetensors").wait()
        folder = root / live_export_folder(1, ckpt.manifest().save_id)
    assert result.spooled_chunks > 0
    tensors = _exported(folder)
    for name, value in net.state_dict().items():
        assert torch.equal(tensors[name], value), name


@pytest.mark.thread_only
def test_a_slow_destination_holds_back_the_save_not_its_memory(tmp_path: Path, monkeypatch: Any) -> None:
    """Part uploads far slower than the capture: the parts waiting for their upload once
    piled up (24 MiB of a 24 MiB export); now a chunk's upload waits for them, holding its
    slab, so the part buffers stay near a quarter of ram_budget plus the parts being filled."""
    import asyncio

    from aiosnap.interop.safetensors import live

    class SlowParts(FaultyStorage):
        lock: asyncio.Lock | None = None

        def part_size_for(self, size: int) -> int:
            return 256 * 1024

        async def upload_part(self, *args: Any) -> Any:
            SlowParts.lock = SlowParts.lock or asyncio.Lock()
            async with SlowParts.lock:  # one link, 25 MB/s
                await asyncio.sleep(0.01)
                return await super().upload_part(*args)

    peak = [0]
    real_copy = live.LiveExport._copy

    def copy(self: Any, index: int, data: memoryview) -> Any:
        done = real_copy(self, index, data)
        peak[0] = max(peak[0], sum(len(i.buffer) for i in self.filling if i.buffer is not None))
        return done

    monkeypatch.setattr(live.LiveExport, "_copy", copy)
    generator = torch.Generator().manual_seed(8)
    state = {"model": {f"w{i}": torch.randn(512, 512, generator=generator) for i in range(24)}}  # 24 MiB
    root = tmp_path / "ckpt"
    config = {"storage": {"url": str(root)}, "upload": {"chunk_size": "1MiB", "concurrency": 4}, "ram_budget": "8MiB"}
    with SyncCheckpointer(config, storage=SlowParts(LocalStorage(root))) as ckpt:
        ckpt.save(state, step=1, also_as="safetensors").wait()
        folder = root / live_export_folder(1, ckpt.manifest().save_id)
    assert peak[0] <= 8 * 1024**2, peak[0] / 1024**2  # 2 MiB allowed waiting, about 5 chunks' worth being filled
    tensors = _exported(folder)
    assert all(torch.equal(tensors[name], value) for name, value in state["model"].items())
