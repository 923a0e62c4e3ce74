"""``aiosnap.dcp.Stager``: buffers reused between saves, one per place in the state, within
the RAM budget and, past it, within the spool budget in files that nothing outlives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from aiosnap import ConfigError
from aiosnap.dcp import Stager, StorageWriter, load
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(60),
]

SMALL = {"ram_budget": "1MiB", "upload": {"chunk_size": "64KiB"}, "events": {"log": False}}


def test_stager_reuses_its_buffers_within_the_budget(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    stager = Stager({"ram_budget": "1MiB", "spool": {"dir": str(spool)}, "events": {"log": False}})
    state = {"small": torch.arange(100_000.0), "big": torch.randn(300_000), "n": 3}  # 0.4 MB in RAM, 1.2 MB past it
    first = stager.stage(state)
    assert first["small"].data_ptr() != state["small"].data_ptr()
    assert first["big"].untyped_storage().filename  # the part past the budget: mapped from a spool file
    state["small"] += 1
    second = stager.stage(state)
    assert second["small"].data_ptr() == first["small"].data_ptr()  # the same buffer, reused
    assert torch.equal(second["small"], state["small"]) and torch.equal(second["big"], state["big"])
    folder = tmp_path / "ck"
    future = dcp.async_save(state, storage_writer=StorageWriter(folder, SMALL), async_stager=stager, no_dist=True)
    state["small"] += 1  # as soon as async_save returned, training may change the state
    future.result(timeout=30)
    assert torch.equal(load(None, folder)["small"], state["small"] - 1)
    stager.close()
    with pytest.raises(ConfigError, match="past ram_budget"):
        Stager({"ram_budget": "1MiB"}).stage({"x": torch.randn(1_000_000)})


def test_places_that_print_alike_get_buffers_of_their_own(tmp_path: Path) -> None:
    state = {
        "a/b": torch.ones(4),
        "a": {"b": torch.full((4,), 2.0), 1: torch.full((4,), 3.0), "1": torch.full((4,), 4.0)},
        "l": [torch.full((4,), 5.0)],
        "l/0": torch.full((4,), 6.0),
    }
    staged = Stager({"ram_budget": "1MiB", "events": {"log": False}}).stage(state)
    pairs = [
        (staged["a/b"], state["a/b"]), (staged["a"]["b"], state["a"]["b"]), (staged["a"][1], state["a"][1]),
        (staged["a"]["1"], state["a"]["1"]), (staged["l"][0], state["l"][0]), (staged["l/0"], state["l/0"]),
    ]  # fmt: skip
    for got, expected in pairs:
        assert torch.equal(got, expected)
    assert len({got.data_ptr() for got, _ in pairs}) == len(pairs)
    folder = tmp_path / "ck"
    saved = {"a/b": state["a/b"], "a": {"b": state["a"]["b"]}}
    future = dcp.async_save(
        saved, storage_writer=StorageWriter(folder, SMALL), async_stager=Stager(SMALL),
        async_checkpointer_type=AsyncCheckpointerType.THREAD, no_dist=True,
    )  # fmt: skip
    future.result(timeout=30)
    target = {"a/b": torch.zeros(4), "a": {"b": torch.zeros(4)}}
    dcp.load(target, storage_reader=FileSystemReader(folder), no_dist=True)
    assert torch.equal(target["a/b"], state["a/b"]) and torch.equal(target["a"]["b"], state["a"]["b"])


def test_spills_stay_within_the_spool_budget_and_leave_no_file(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    stager = Stager({"ram_budget": "64KiB", "spool": {"dir": str(spool), "budget": "1MiB"}, "events": {"log": False}})
    with pytest.raises(ConfigError, match=r"past spool.budget \(0 of 1048576 bytes used"):
        stager.stage({"x": torch.randn(2_000_000)})  # 8 MB
    for n in range(5):  # a buffer whose shape changes: the old one's spool space comes back
        x = torch.randn(200_000 + n)
        staged = stager.stage({"x": x})
        assert torch.equal(staged["x"], x) and staged["x"].untyped_storage().filename
        assert os.listdir(spool) == []  # mapped, then unlinked: a killed process leaves nothing either
    stager.close()
