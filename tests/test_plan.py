"""Planning is pure: flattening, batching small tensors, splitting large ones."""

from __future__ import annotations

import pytest
import torch
from aiosnap.trainer.chunks import ALIGN
from aiosnap.trainer.plan import make_plan


def test_small_tensors_are_batched_and_aligned() -> None:
    state = {f"t{i}": torch.zeros(10) for i in range(20)}  # 40 bytes each
    plan = make_plan(state, step=1, chunk_bytes=4096)
    assert len(plan.chunks) == 1
    offsets = [p.dst_offset for p in plan.chunks[0].pieces]
    assert offsets == [i * ALIGN for i in range(20)]


def test_large_tensor_is_split_on_element_boundaries() -> None:
    plan = make_plan({"big": torch.zeros(1000, dtype=torch.float64)}, step=3, chunk_bytes=1000)
    sizes = [c.nbytes for c in plan.chunks]
    assert sum(sizes) == 8000 and max(sizes) <= 1000
    assert all(p.nbytes % 8 == 0 for c in plan.chunks for p in c.pieces)
    assert plan.chunks[0].object_name == f"000000000003/{plan.save_id}/rank-0/0.bin"


def test_each_plan_gets_a_unique_save_id() -> None:
    ids = {make_plan({"x": torch.ones(1)}, step=1, chunk_bytes=4096).save_id for _ in range(50)}
    assert len(ids) == 50


def test_stateful_objects_are_flattened_through_state_dict() -> None:
    model = torch.nn.Linear(3, 2)
    plan = make_plan({"model": model}, step=0, chunk_bytes=4096)
    assert sorted(e.path for e in plan.entries) == ["model/bias", "model/weight"]
    assert plan.spec.tree["items"][0][1]["t"] == "stateful"


@pytest.mark.parametrize("bad", [{"step": -1}, {"step": 1.5}, {"step": True}])
def test_step_must_be_a_non_negative_int(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="step"):
        make_plan({"x": torch.ones(1)}, chunk_bytes=4096, **bad)  # type: ignore[arg-type]


def test_state_must_be_a_dict() -> None:
    with pytest.raises(TypeError, match="dict"):
        make_plan([torch.ones(1)], step=1, chunk_bytes=4096)  # type: ignore[arg-type]


def test_the_dtype_table_is_torchs() -> None:
    from aiosnap.format.dtypes import DTYPE_ITEMSIZE

    canonical = {
        str(d).removeprefix("torch."): d.itemsize
        for d in (getattr(torch, n) for n in dir(torch))
        if isinstance(d, torch.dtype)
    }
    assert canonical == DTYPE_ITEMSIZE


def test_every_device_type_a_tree_may_name_is_torchs() -> None:
    from aiosnap.format.tree import DEVICE_TYPES

    for name in DEVICE_TYPES:
        assert torch.device(f"{name}:0").type == name
