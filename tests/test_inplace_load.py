"""``load(state)`` in place (issue 12): bytes go straight into the caller's tensors, no second
copy of the state; integrity is still checked per range; ``atomic=True`` keeps the old
all-or-nothing behaviour."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import ChecksumMismatchError, Config, StateMismatchError, SyncCheckpointer
from tests.conftest import count_fresh_tensors, damage_entry


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(8, 32)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Config, dict[str, Any]]:
    config = Config(storage={"url": str(tmp_path)}, upload={"chunk_size": "64KiB"})
    model, optim = _trained(0)
    with SyncCheckpointer(config) as ckpt:
        ckpt.save({"model": model, "optim": optim, "bias": torch.arange(6.0)}, step=1).wait()
    expected = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "adam": {i: {k: v.clone() for k, v in s.items()} for i, s in optim.state_dict()["state"].items()},
    }
    return config, expected


def test_a_module_and_its_optimizer_are_loaded_in_place(
    saved: tuple[Config, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    config, expected = saved
    model, optim = _trained(1)  # other values, same shapes
    bias = torch.zeros(6)
    addresses = {name: t.data_ptr() for name, t in model.state_dict().items()}
    moments = {index: state["exp_avg"] for index, state in enumerate(optim.state.values())}
    made = count_fresh_tensors(monkeypatch)
    with SyncCheckpointer(config) as ckpt:
        ckpt.load({"model": model, "optim": optim, "bias": bias})
    assert not [p for p in made if not p.endswith("step")], f"fresh tensors made for {made}"
    for name, tensor in model.state_dict().items():
        assert tensor.data_ptr() == addresses[name], f"{name} was replaced, not loaded in place"
        assert torch.equal(tensor, expected["model"][name]), name
    assert torch.equal(bias, torch.arange(6.0))
    for index, state in enumerate(optim.state.values()):
        assert state["exp_avg"] is moments[index]  # the optimizer's own tensors, updated
        assert torch.equal(state["exp_avg"], expected["adam"][index]["exp_avg"])


def test_targets_that_cannot_take_the_bytes_are_copied_into(saved: tuple[Config, dict[str, Any]]) -> None:
    config, _ = saved
    wide = torch.zeros(6, dtype=torch.float64)  # another dtype
    strided = torch.zeros(12)[::2]  # not contiguous
    with SyncCheckpointer(config) as ckpt:
        ckpt.load({"bias": wide})
        ckpt.load({"bias": strided})
    assert torch.equal(wide, torch.arange(6.0, dtype=torch.float64))
    assert torch.equal(strided, torch.arange(6.0))


def test_a_damaged_range_names_the_tensors_loaded_in_place_and_atomic_touches_nothing(
    saved: tuple[Config, dict[str, Any]],
) -> None:
    config, _ = saved
    damage_entry(config, "model/0.weight", at=10, mask=0x01)

    model, _ = _trained(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with SyncCheckpointer(config) as ckpt:
        with pytest.raises(ChecksumMismatchError, match="atomic=True") as caught:
            ckpt.load({"model": model})
        assert "'model/0.weight'" in str(caught.value) and "partly loaded" in str(caught.value)
        model, _ = _trained(1)
        with pytest.raises(ChecksumMismatchError) as caught:
            ckpt.load({"model": model}, atomic=True)
        assert "partly loaded" not in str(caught.value)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} changed although the atomic load failed"


def test_tensors_sharing_memory_are_never_both_read_into(tmp_path: Path) -> None:
    config = Config(storage={"url": str(tmp_path)})
    with SyncCheckpointer(config) as ckpt:
        ckpt.save({"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0)}, step=1).wait()
        shared = torch.zeros(4)
        ckpt.load({"a": shared, "b": shared})  # the same tensor twice: copied, the last one wins
        assert torch.equal(shared, torch.full((4,), 2.0))
        buffer = torch.zeros(6)
        ckpt.load({"a": buffer[:4], "b": buffer[2:]})  # overlapping views
        assert torch.equal(buffer, torch.tensor([1.0, 1.0, 2.0, 2.0, 2.0, 2.0]))


class _Accumulating:
    """A Stateful whose state_dict() cannot be taken before it is set up."""

    def __init__(self) -> None:
        self.w: torch.Tensor | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.w is None:
            raise RuntimeError("not set up yet")
        return {"w": self.w}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w = state["w"].clone()


class _Refusing:
    def __init__(self) -> None:
        self.w = torch.full((4,), 2.0)

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ValueError("incompatible version")


def test_found_by_review_lists_stateful_objects_autograd_and_aliases(tmp_path: Path) -> None:
    config = Config(storage={"url": str(tmp_path)})
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(
            {"l": [torch.ones(4)], "obj": {"w": torch.arange(4.0)}, "p": torch.ones(3), "a": torch.arange(4.0)},
            step=1,
        ).wait()
        kept = torch.zeros(4)
        state: dict[str, Any] = {"l": [kept]}
        ckpt.load(state)  # a list of the state is replaced, as with atomic=True: its old tensors stay
        assert torch.count_nonzero(kept) == 0 and torch.equal(state["l"][0], torch.ones(4))

        late = _Accumulating()  # state_dict() raises: restored from new tensors
        ckpt.load({"obj": late})
        assert late.w is not None and torch.equal(late.w, torch.arange(4.0))

        refusing = _Refusing()
        with pytest.raises(ValueError, match="incompatible") as caught:
            ckpt.load({"obj": refusing})
        assert any("partly loaded" in note for note in getattr(caught.value, "__notes__", []))

        leaf = torch.nn.Parameter(torch.zeros(3))
        loss = (leaf * leaf).sum()
        ckpt.load({"p": leaf})  # written in place: autograd must know
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()

        buffer = torch.zeros(4)
        view = buffer[:]  # another tensor the load writes, over the same bytes
        ckpt.load({"a": buffer, "p": view[:3]})
        assert torch.equal(buffer, torch.tensor([1.0, 1.0, 1.0, 3.0]))


def test_a_step_saved_from_a_module_loads_into_a_plain_dict_of_its_tensors(
    saved: tuple[Config, dict[str, Any]],
) -> None:
    """Half of it was read in place, then the dict was replaced by the checkpoint's, and
    a key the checkpoint lacked was never reported."""
    config, expected = saved
    weights = {k: torch.zeros_like(v) for k, v in expected["model"].items()}
    weights["1.bias"] = weights["1.bias"].double()  # another dtype: copied into, converted
    target = {"model": weights}
    with SyncCheckpointer(config) as ckpt:
        ckpt.load(target)
        assert target["model"] is weights  # the caller's dict, loaded: not replaced
        for name, tensor in weights.items():
            assert torch.equal(tensor, expected["model"][name].to(tensor.dtype)), name
        assert weights["1.bias"].dtype == torch.float64
        with pytest.raises(StateMismatchError, match="model: key\\(s\\) \\['extra'\\] are not in checkpoint"):
            ckpt.load({"model": {**weights, "extra": torch.zeros(1)}})
        module, _ = _trained(2)
        ckpt.load({"model": module.double().state_dict()})  # a module's state dict of other dtypes
        for name, tensor in module.state_dict().items():
            assert torch.equal(tensor, expected["model"][name].double()), name


def test_a_meta_tensor_target_is_refused_never_left_unloaded(saved: tuple[Config, dict[str, Any]]) -> None:
    config, expected = saved
    with torch.device("meta"):
        on_meta = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 4))
    with SyncCheckpointer(config) as ckpt:
        for atomic in (False, True):
            with pytest.raises(StateMismatchError, match="'bias': a tensor on the meta device"):
                ckpt.load({"bias": torch.empty(6, device="meta")}, atomic=atomic)
            with pytest.raises(StateMismatchError, match="'model/0.weight', 'model/0.bias'.*meta device"):
                ckpt.load({"model": on_meta}, atomic=atomic)
        on_meta.to_empty(device="cpu")  # the way out the message names
        ckpt.load({"model": on_meta})
        assert torch.equal(on_meta.state_dict()["1.weight"], expected["model"]["1.weight"])
