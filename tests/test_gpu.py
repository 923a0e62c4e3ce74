"""CUDA capture path: copy stream ordered after the caller's stream, pinned slabs."""

from __future__ import annotations

import pytest
import torch
from aiosnap import Config, SyncCheckpointer

pytestmark = [
    pytest.mark.both_executors,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_tensors_round_trip_and_use_pinned_slabs(small_config: Config) -> None:
    state = {
        "w": torch.randn(300_000, device="cuda"),
        "b": torch.randn(7, device="cuda").to(torch.bfloat16),
        "strided": torch.randn(64, 512, device="cuda").t(),
    }
    expected = {k: v.cpu() for k, v in state.items()}
    with SyncCheckpointer(small_config) as ckpt:
        ckpt.save(state, step=1).wait()
        assert ckpt._engine._pool is not None and ckpt._engine._pool.pin_memory
        restored = ckpt.load()
    for key, value in expected.items():
        assert torch.equal(restored[key], value.contiguous()), key


def test_capture_sees_work_queued_before_save_not_after(small_config: Config) -> None:
    x = torch.zeros(4_000_000, device="cuda")
    torch.cuda._sleep(50_000_000)  # keep the caller's stream busy
    x.add_(1)  # queued before save(): must be in the checkpoint
    with SyncCheckpointer(small_config) as ckpt:
        handle = ckpt.save({"x": x}, step=1)
        x.add_(1)  # queued after save() returned: must not be
        handle.wait()
        assert torch.equal(ckpt.load()["x"], torch.ones(4_000_000))


def test_in_place_load_into_cuda_module(small_config: Config) -> None:
    model = torch.nn.Linear(64, 64).cuda()
    with SyncCheckpointer(small_config) as ckpt:
        ckpt.save({"model": model}, step=1).wait()
        other = torch.nn.Linear(64, 64).cuda()
        ckpt.load({"model": other})
    assert torch.equal(other.weight, model.weight)
