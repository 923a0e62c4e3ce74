"""CUDA paths: capture on a copy stream ordered after the caller's stream, into pinned
slabs; loads into CUDA tensors in place, through pinned staging slabs and a copy stream."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from aiosnap import Config, SyncCheckpointer
from tests.conftest import count_fresh_tensors
from tests.memory_probe import SLACK, needs_peak_rss, run_probe

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
        assert ckpt._engine.pool is not None and ckpt._engine.pool._pinned
        restored = ckpt.load()
    for key, value in expected.items():
        assert torch.equal(restored[key], value.contiguous()), key


def test_only_the_slabs_a_cuda_save_uses_are_pinned(root: Path) -> None:
    """Registering pins (and makes resident) what it covers: a state far smaller than the
    budget registers the slabs it used, not the budget."""
    config = Config(storage={"url": str(root)}, ram_budget="256MiB", upload={"chunk_size": "4MiB"})
    state = {"w": torch.randn(2_000_000, device="cuda")}  # 8 MB: two slabs of 4 MiB
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(state, step=1).wait()
        pool = ckpt._engine.pool
        assert pool is not None and pool._pinned and not pool._pin_failed
        assert 0 < pool._pinned_to <= 2 * pool.slab_bytes < pool.arena.size
        assert torch.equal(ckpt.load()["w"], state["w"].cpu())


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


def test_a_cuda_module_and_optimizer_load_in_place_through_pinned_slabs(
    small_config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 8)).cuda()
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256, device="cuda")).sum().backward()
    optim.step()
    with SyncCheckpointer(small_config) as ckpt:
        ckpt.save({"model": model, "optim": optim}, step=1).wait()
        other = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 8)).cuda()
        other_optim = torch.optim.Adam(other.parameters())
        other(torch.randn(4, 256, device="cuda")).sum().backward()
        other_optim.step()
        addresses = {name: t.data_ptr() for name, t in other.state_dict().items()}
        made = count_fresh_tensors(monkeypatch)
        ckpt.load({"model": other, "optim": other_optim})
        assert ckpt._engine.pool is not None and ckpt._engine.pool._pinned
    assert [p for p in made if not p.endswith("step")] == [], made  # Adam's step counters are CPU scalars
    for name, tensor in other.state_dict().items():
        assert tensor.data_ptr() == addresses[name], f"{name} was replaced, not loaded in place"
        assert torch.equal(tensor, model.state_dict()[name]), name
    for mine, theirs in zip(other_optim.state.values(), optim.state.values(), strict=True):
        assert torch.equal(mine["exp_avg"], theirs["exp_avg"])


def test_a_staged_load_comes_after_work_the_caller_queued(small_config: Config) -> None:
    with SyncCheckpointer(small_config) as ckpt:
        ckpt.save({"x": torch.ones(4_000_000, device="cuda")}, step=1).wait()
        x = torch.zeros(4_000_000, device="cuda")
        torch.cuda._sleep(50_000_000)  # keep the caller's stream busy
        x.add_(5)  # queued before load(): the load's copy must land after it
        ckpt.load({"x": x})
    assert torch.equal(x, torch.ones(4_000_000, device="cuda"))


@needs_peak_rss
def test_a_cuda_load_ten_times_the_budget_stays_within_budget_in_host_memory(tmp_path: Path) -> None:
    figures = run_probe(tmp_path, 16, "staged-load", "cuda")
    assert figures["values_equal"] and figures["state_bytes"] >= 10 * figures["budget"]
    assert figures["rss_increase"] <= figures["budget"] + SLACK, figures
