"""Exporting aiosnap checkpoints as Hugging Face safetensors folders (and importing them
back), checked with the safetensors library itself: shards of at most the size asked for,
the index HF tools read, the documented name rule, dtype conversion, every tensor equal."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import AiosnapError, Config, SyncCheckpointer
from aiosnap.cli import main
from aiosnap.interop.safetensors.api import export, open_safetensors
from aiosnap.interop.safetensors.layout import INDEX_FILE, hf_name
from aiosnap.interop.safetensors.reader import SafetensorsFolder
from aiosnap.interop.safetensors.to_aiosnap import import_manifest
from aiosnap.storage.local import LocalStorage
from safetensors import safe_open
from safetensors.torch import load_file
from tests.conftest import FaultyStorage


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32))
    net.register_buffer("counts", torch.arange(7, dtype=torch.int64))
    net.register_buffer("mask", torch.tensor([True, False, True]))
    return net


def _state(net: torch.nn.Module) -> dict[str, Any]:
    optim = torch.optim.Adam(net.parameters())
    net(torch.randn(2, 64)).sum().backward()
    optim.step()
    return {"model": net, "optim": optim, "step": 5, "extra": {"table": _table()}}


def _table() -> torch.Tensor:
    return torch.arange(100, dtype=torch.float64).reshape(10, 10) / 7


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """An aiosnap root with small chunks (tensors split across data objects)."""
    net = _model()
    root = tmp_path / "ckpt"
    config = {"storage": {"url": str(root)}, "upload": {"chunk_size": "64KiB"}, "ram_budget": "1MiB"}
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(_state(net), step=10).wait()
    return root, net


def _read_folder(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    index = json.loads((folder / INDEX_FILE).read_text())
    found: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(folder / file)
        assert set(tensors).isdisjoint(found)
        found.update(tensors)
    assert set(found) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in found.values())
    return found, index["weight_map"]


def test_export_writes_what_the_library_reads(saved: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    root, net = saved
    out = tmp_path / "hf"
    report = export(str(root), str(out), paths=["model/*"], max_shard_size="20KB", metadata={"origin": "test"})
    tensors, weight_map = _read_folder(out)
    assert set(tensors) == set(net.state_dict())  # "model/" stripped, module names kept
    for name, value in net.state_dict().items():
        assert torch.equal(tensors[name], value), name
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(report.files)
    assert all(name.startswith(".") is False for name in files)  # no temporary file left
    for file in set(weight_map.values()):
        with safe_open(str(out / file), framework="pt") as f:
            assert f.metadata() == {"format": "pt", "origin": "test"}
            data = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())  # noqa: SIM118
        assert data <= 20_000 or len(list(k for k, v in weight_map.items() if v == file)) == 1
    assert len(set(weight_map.values())) >= 3
    assert report.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_the_name_rule_dtype_conversion_and_an_override(saved: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    root, net = saved
    assert hf_name("model/0.weight") == "0.weight"
    assert hf_name("optim/state/0/exp_avg") == "optim.state.0.exp_avg"
    assert hf_name("model/layers/0/w", strip="") == "model.layers.0.w"
    out = tmp_path / "all"
    export(str(root), str(out), dtype="bf16")  # every tensor, floating ones as bfloat16
    tensors, _ = _read_folder(out)
    assert tensors["0.weight"].dtype == torch.bfloat16
    assert torch.equal(tensors["0.weight"], net.state_dict()["0.weight"].to(torch.bfloat16))
    assert tensors["counts"].dtype == torch.int64 and tensors["mask"].dtype == torch.bool  # not floating: kept
    assert torch.equal(tensors["extra.table"], _table().to(torch.bfloat16))
    assert "optim.state.0.exp_avg" in tensors and "step" not in tensors  # plain values are not tensors
    renamed = tmp_path / "renamed"
    export(str(root), str(renamed), names={"model/0.weight": "encoder.weight"})
    tensors, _ = _read_folder(renamed)
    assert list(tensors) == ["encoder.weight"]
    with pytest.raises(ValueError, match="would both be named"):
        export(str(root), str(tmp_path / "clash"), names=lambda path: "same" if path.startswith("model/") else None)
    with pytest.raises(ValueError, match="no tensor"):
        export(str(root), str(tmp_path / "none"), paths=["nothing/*"])


def test_an_existing_export_is_replaced_only_when_asked(saved: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    root, _ = saved
    out = tmp_path / "hf"
    export(str(root), str(out), paths=["model/*"], max_shard_size="10KB")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(FileExistsError, match="overwrite"):
        export(str(root), str(out), paths=["model/*"])
    assert sorted(p.name for p in out.iterdir()) == before
    export(str(root), str(out), paths=["model/*"], overwrite=True)  # one shard now: the old ones go
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00001.safetensors", INDEX_FILE]
    with pytest.raises(AiosnapError, match="overlap"):  # never written where it is read from
        export(str(out), str(out), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00001.safetensors", INDEX_FILE]


def test_import_into_an_aiosnap_root_and_back(saved: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    """safetensors -> aiosnap (every range gets a crc32c) -> load in place into a model."""
    root, net = saved
    out, back = tmp_path / "hf", tmp_path / "back"
    export(str(root), str(out), paths=["model/*"], max_shard_size="10KB")
    export(str(out), str(back), to="aiosnap", dest_step=3)
    assert main(["verify", str(back)]) == 0
    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    with SyncCheckpointer({"storage": {"url": str(back)}, "ram_budget": "1MiB"}) as ckpt:
        assert ckpt.steps() == [3]
        assert all(r.crc32c is not None for _, r in ckpt.manifest().all_ranges())
        ckpt.load({"model": fresh})
    for name, value in net.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_load_straight_from_a_folder_in_place_and_converted(
    saved: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    root, net = saved
    out = tmp_path / "hf"
    export(str(root), str(out), paths=["model/*"])
    half = _model().to(torch.float16)  # another dtype: the load converts as it copies
    with SyncCheckpointer({"ram_budget": "1MiB"}, storage=open_safetensors(str(out))) as ckpt:
        ckpt.load({"model": half})
        partial = ckpt.load(paths=["model/0.*"])
    for name, value in net.state_dict().items():
        expected = value.to(torch.float16) if value.is_floating_point() else value
        assert torch.equal(half.state_dict()[name], expected), name
    assert set(partial["model"]) == {"0.weight", "0.bias"}


def test_the_command_line(
    saved: tuple[Path, torch.nn.Module], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, net = saved
    out = tmp_path / "cli"
    args = [
        "export",
        str(root),
        str(out),
        "--paths",
        "model/*",
        "--max-shard-size",
        "30KB",
        "--dtype",
        "fp16",
        "--json",
    ]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["files"][-1] == INDEX_FILE
    tensors, _ = _read_folder(out)
    assert torch.equal(tensors["2.weight"], net.state_dict()["2.weight"].half())
    assert main(args) == 1  # exists already
    assert "--overwrite" in capsys.readouterr().err
    assert main(["export", str(root), str(tmp_path / "x"), "--dtype", "int3"]) == 1
    assert "dtype 'int3'" in capsys.readouterr().err


def test_a_single_file_checkpoint_exports_too(tmp_path: Path) -> None:
    net = _model()
    target = tmp_path / "model.ckpt"
    target.touch()  # an existing file: a single-file checkpoint
    with SyncCheckpointer({"storage": {"url": str(target)}, "ram_budget": "1MiB"}) as ckpt:
        ckpt.save({"model": net}, step=1).wait()
    export(str(target), str(tmp_path / "hf"))
    tensors, _ = _read_folder(tmp_path / "hf")
    assert torch.equal(tensors["0.weight"], net.state_dict()["0.weight"])


def test_an_export_stays_within_its_ram_budget(tmp_path: Path) -> None:
    """Stored ranges larger than the budget leaves for them (16 MiB each, 16 MiB of budget:
    8 MiB for parts, 8 MiB for source ranges) are streamed through, never read whole into
    memory beside the parts; every byte still arrives, verified."""
    generator = torch.Generator().manual_seed(9)
    state = {"model": {f"w{i}": torch.randn(4 * 1024, 1024, generator=generator) for i in range(2)}}
    root = tmp_path / "ckpt"
    config = {"storage": {"url": str(root)}, "upload": {"chunk_size": "16MiB"}, "ram_budget": "64MiB"}
    with SyncCheckpointer(config) as c:
        c.save(state, step=1).wait()
        assert max(r.nbytes for _, r in c.manifest().all_ranges()) == 16 * 1024**2
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        export(str(root), str(tmp_path / "hf"), config=Config(ram_budget="16MiB"))
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    # the budget, plus the modules the export imports and small transients; each 16 MiB range read whole
    # beside the parts (outside the budget) made it 40 MiB
    assert peak < 24 * 1024**2, peak / 1024**2
    tensors, _ = _read_folder(tmp_path / "hf")
    assert all(torch.equal(tensors[name], value) for name, value in state["model"].items())


def test_an_import_whose_commit_answer_is_lost_is_committed_and_whole(tmp_path: Path) -> None:
    """The manifest lands, then its write raises (a retried conditional PUT answered 412, a
    timeout after the body went): the import reads back whose the step is, finds it its
    own, and keeps its data (it once deleted the data of the step it had just committed)."""
    from safetensors.torch import save_file

    source_dir = tmp_path / "hf"
    source_dir.mkdir()
    values = torch.arange(1000, dtype=torch.float32)
    save_file({"w": values}, str(source_dir / "model.safetensors"))
    for number, error in enumerate([FileExistsError("412 Precondition Failed"), TimeoutError("read timeout")]):
        dest = FaultyStorage(LocalStorage(tmp_path / f"root{number}"), error=error)
        dest.lose_answer_when = lambda name: name.endswith("manifest.json")

        async def run(dest: FaultyStorage) -> None:
            source = SafetensorsFolder(LocalStorage(source_dir))
            await import_manifest(source, await source.manifest(), dest, step=0)

        asyncio.run(run(dest))
        with SyncCheckpointer({"storage": {"url": str(tmp_path / f"root{number}")}, "ram_budget": "1MiB"}) as ckpt:
            assert ckpt.steps() == [0]
            assert torch.equal(ckpt.load()["model"]["w"], values)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_torch_save_file_and_a_dcp_folder_export_to_safetensors(tmp_path: Path) -> None:
    """Every format the converter reads is a source of a safetensors export too."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}, "step": 3}
    torch.save(state, tmp_path / "plain.pt")
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    for source in ("plain.pt", "dcp"):
        out = tmp_path / f"hf-{source}"
        report = export(str(tmp_path / source), str(out))
        assert report.tensors == 2, (source, report)
        loaded = load_file(str(out / report.files[0]))
        assert set(loaded) == {"w", "b"}, source
        assert torch.equal(loaded["w"], state["model"]["w"]) and torch.equal(loaded["b"], state["model"]["b"])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_safetensors_folder_converts_to_every_format(tmp_path: Path) -> None:
    """The converter reads a Hugging Face folder like any other source: to torch.save, to a
    DCP checkpoint torch's own reader loads, to an aiosnap root; ``aiosnap ls`` names it."""
    import torch.distributed.checkpoint as dcp
    from aiosnap import export as export_any
    from safetensors.torch import save_file

    weights = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    (tmp_path / "hf").mkdir()
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
    export_any(str(tmp_path / "hf"), str(tmp_path / "o.pt"), to="torch")
    saved = torch.load(tmp_path / "o.pt", weights_only=True)["model"]
    assert all(torch.equal(saved[name], value) for name, value in weights.items())
    export_any(str(tmp_path / "hf"), str(tmp_path / "dcp"), to="dcp")
    target = {"model": {name: torch.zeros_like(value) for name, value in weights.items()}}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"))
    assert all(torch.equal(target["model"][name], value) for name, value in weights.items())
    export_any(str(tmp_path / "hf"), str(tmp_path / "root"), to="aiosnap")
    with SyncCheckpointer(str(tmp_path / "root")) as ckpt:
        assert torch.equal(ckpt.load()["model"]["w"], weights["w"])
    listed = subprocess.run([sys.executable, "-m", "aiosnap", "ls", str(tmp_path / "hf")],
                            capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert listed.returncode == 0 and "a safetensors folder" in listed.stderr, listed.stderr
