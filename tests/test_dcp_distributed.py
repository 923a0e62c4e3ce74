"""DCP checkpoints of an FSDP2 model and its optimizer (DTensors), saved by 2 gloo ranks --
through aiosnap's writer (``dcp.save``, ``async_save`` with the THREAD and the PROCESS
executor) and through torch's ``FileSystemWriter`` -- then loaded resharded: on 4 ranks
(another mesh: DCP with aiosnap's and torch's readers, and aiosnap's own load path in place
into the DTensors) and in 1 process (full tensors). Real processes (tests/dcp_child.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from aiosnap import export
from aiosnap.dcp import StorageReader, load
from tests.conftest import assert_same
from torch.distributed.checkpoint import FileSystemReader

from dist_launch import ok, run_ranks

CHILD = Path(__file__).resolve().parent / "dcp_child.py"
VARIANTS = ("aiosnap", "torch", "thread", "process")

pytestmark = [
    pytest.mark.timeout(150),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


@pytest.fixture(scope="module")
def saved_by_2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp-saved-by-2")
    results = ok(run_ranks("save_fsdp", 2, root / "job", timeout=120, child=CHILD, root=str(root)), root / "job")
    files = results[0]["files"]
    assert any(f.startswith("__0_") for f in files) and any(f.startswith("__1_") for f in files)
    return root


def test_two_ranks_resharded_onto_four(saved_by_2: Path, tmp_path: Path) -> None:
    results = ok(run_ranks("load_fsdp", 4, tmp_path / "job", timeout=120, child=CHILD, root=str(saved_by_2)), tmp_path)
    for rank, found in enumerate(results):
        assert found and all(found.values()), (rank, found)


def _zeros(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _zeros(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_zeros(v) for v in value]
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else value


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_consolidated_in_one_process(saved_by_2: Path, variant: str) -> None:
    expected = torch.load(saved_by_2 / "expected.pt", weights_only=True)
    folder = saved_by_2 / variant
    restored = load(None, folder)  # aiosnap's own path: full tensors from both ranks' shards
    assert_same(restored["model"], expected["model"])
    assert_same(restored["optim"]["state"], expected["optim"]["state"])
    assert restored["optim"]["param_groups"] == expected["optim"]["param_groups"]
    assert restored["train"] == expected["train"]
    readers = [StorageReader(folder)] + ([FileSystemReader(folder)] if variant != "torch" else [])
    for reader in readers:
        target = _zeros(expected)
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert_same(target["model"], expected["model"])
        assert_same(target["optim"]["state"], expected["optim"]["state"])


@pytest.mark.parametrize("source", ["aiosnap", "torch", "native"])
@pytest.mark.parametrize("to", ["torch", "dcp"])
def test_multi_rank_sources_export_consolidated(saved_by_2: Path, source: str, to: str, tmp_path: Path) -> None:
    """Shards of both ranks become full tensors (aiosnap's own multi-rank format too, whose
    rank-local values are taken as rank 0 saved them)."""
    expected = torch.load(saved_by_2 / "expected.pt", weights_only=True)
    dest = tmp_path / ("out.pt" if to == "torch" else "out")
    export(str(saved_by_2 / source), str(dest), to=to, config={"ram_budget": "1MiB", "upload": {"chunk_size": "64KiB"}})
    if to == "torch":
        loaded = torch.load(dest, weights_only=True)
    else:
        loaded = _zeros({**expected, **({"rank": {"seed": 0}} if source == "native" else {})})
        dcp.load(loaded, storage_reader=FileSystemReader(dest), no_dist=True)
    assert_same(dict(loaded["model"]), expected["model"])  # (aiosnap keeps an OrderedDict as such)
    assert_same(loaded["optim"]["state"], expected["optim"]["state"])
    if source == "native":
        assert loaded["rank"] == {"seed": 100}
