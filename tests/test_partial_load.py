"""Partial loads (issue 12): ``load(state)`` reads only the keys ``state`` has, and
``load(paths=[...])`` only the key paths asked for; nothing else is read or checked."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import Config, StateMismatchError, SyncCheckpointer
from aiosnap.storage.local import LocalStorage
from tests.conftest import FaultyStorage, damage_entry


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optim.step()
    return {
        "model": model,
        "optim": optim,
        "big": torch.randn(2_000_000),  # 8 MB nobody asks for
        "extra": {"odd": {1, 2}},  # a pickled object: needs allow_pickle only when it is read
        "step": 7,
    }


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Config, dict[str, Any]]:
    config = Config(storage={"url": str(tmp_path)}, upload={"chunk_size": "1MiB"}, pickle_values=True)
    state = _state()
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(state, step=1).wait()
    return config, state


def _counted(config: Config) -> tuple[SyncCheckpointer, FaultyStorage]:
    counted = FaultyStorage(LocalStorage(config.storage.url))
    return SyncCheckpointer(config, storage=counted), counted


def test_loading_the_model_reads_only_its_bytes(saved: tuple[Config, dict[str, Any]]) -> None:
    config, state = saved
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    ckpt, counted = _counted(config)
    with ckpt:
        ckpt.load({"model": model})  # no allow_pickle: the pickled object is not read
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert model_bytes <= counted.read_bytes <= model_bytes + 64 * 4, counted.read_bytes
    for name, tensor in state["model"].state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_a_damaged_part_nobody_loads_does_not_fail_a_partial_load(
    saved: tuple[Config, dict[str, Any]],
) -> None:
    config, _ = saved
    damage_entry(config, "big")
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    with SyncCheckpointer(config) as ckpt:
        ckpt.load({"model": model, "step": 0})
        with pytest.raises(Exception, match="checksum mismatch in 'big'"):
            ckpt.load(paths=["big"])


def test_paths_select_parts_of_the_tree(saved: tuple[Config, dict[str, Any]]) -> None:
    config, state = saved
    ckpt, counted = _counted(config)
    with ckpt:
        layer = ckpt.load(paths=["model/0.*"])
        assert set(layer) == {"model"} and set(layer["model"]) == {"0.weight", "0.bias"}
        assert torch.equal(layer["model"]["0.weight"], state["model"][0].weight)
        assert counted.read_bytes <= (64 * 64 + 64) * 4 + 64 * 2
        both = ckpt.load(paths=["step", "optim/param_groups"])
        assert both == {"step": 7, "optim": {"param_groups": state["optim"].state_dict()["param_groups"]}}
        with pytest.raises(StateMismatchError, match="no key path matches"):
            ckpt.load(paths=["nothing/*"])
        with pytest.raises(TypeError, match="not both"):
            ckpt.load({"step": 0}, paths=["step"])
        with pytest.raises(TypeError, match="list of patterns"):
            ckpt.load(paths="step")  # type: ignore[arg-type]
        assert ckpt.load(paths=["extra"], allow_pickle=True) == {"extra": {"odd": {1, 2}}}


class Color(enum.Enum):
    RED = 1


def test_keys_that_are_tensors_or_pickles_do_not_stop_a_selection(tmp_path: Path) -> None:
    config = Config(storage={"url": str(tmp_path)}, pickle_values=True)
    weights = torch.ones(3)
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(
            {"model": {"w": weights}, "meta": {Color.RED: 1, "x": 1}, "lookup": {torch.tensor([1]): 2}}, step=1
        ).wait()
        selected = ckpt.load(paths=["model/*"])  # no allow_pickle: nothing pickled is read
        assert set(selected) == {"model"} and torch.equal(selected["model"]["w"], weights)
        assert ckpt.load(paths=["meta/x"]) == {"meta": {"x": 1}}


def test_a_key_missing_from_the_checkpoint_is_reported_before_reading(saved: tuple[Config, dict[str, Any]]) -> None:
    config, _ = saved
    ckpt, counted = _counted(config)
    with ckpt, pytest.raises(StateMismatchError, match="are not in checkpoint step 1"):
        ckpt.load({"model": torch.nn.Linear(1, 1), "missing": 0})
    assert counted.read_bytes == 0
    with SyncCheckpointer(config) as again, pytest.raises(ValueError, match="non-empty glob patterns"):
        again.load(paths=[""])


@pytest.mark.parametrize(
    ("state", "where"),
    [
        ({"extra": {}}, r"extra: the dict to load into is empty.*holds key\(s\) \['odd'\]"),
        ({}, r"state: the dict to load into is empty.*\['big', 'extra', 'model', 'optim', 'step'\]"),
        ({"nothing": {}}, r"state: key\(s\) \['nothing'\] are not in checkpoint step 1"),
    ],
)
def test_a_load_that_would_restore_nothing_is_refused_naming_the_key(
    saved: tuple[Config, dict[str, Any]], state: dict[str, Any], where: str
) -> None:
    config, _ = saved
    ckpt, counted = _counted(config)
    with ckpt, pytest.raises(StateMismatchError, match=where):
        ckpt.load(state)
    assert counted.read_bytes == 0, "refused before any data is read"
    with SyncCheckpointer(config) as again:
        empty_saved = {"extra": {}}
        again.save({"extra": {}, "w": torch.ones(2)}, step=2).wait()
        assert again.load(empty_saved) == {"extra": {}}  # empty in the checkpoint too: nothing is missing
