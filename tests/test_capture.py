"""save() captures: what is saved is the state at the call, whatever training does next."""

from __future__ import annotations

import pytest
import torch
from aiosnap import Config, SyncCheckpointer
from aiosnap.core import arena as arena_module
from aiosnap.core.arena import Arena
from aiosnap.errors import UnsupportedStateError
from tests.conftest import FaultyStorage


def test_tensors_mutated_after_save_returns_keep_old_values(small_config: Config, faulty: FaultyStorage) -> None:
    small = torch.arange(10, dtype=torch.float32)
    large = torch.randn(200_000)  # 800 KB: many 64 KiB chunks, more than the 1 MiB budget holds at once
    expected_small, expected_large = small.clone(), large.clone()
    faulty.delay = 0.01  # storage lags behind capture
    with SyncCheckpointer(small_config, storage=faulty) as ckpt:
        handle = ckpt.save({"small": small, "large": large}, step=1)
        small.add_(1)  # training goes on, in place
        large.mul_(-1)
        handle.wait()
        restored = ckpt.load()
    assert torch.equal(restored["small"], expected_small)
    assert torch.equal(restored["large"], expected_large)


def test_model_and_optimizer_mutated_by_training_after_save(small_config: Config) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 256)).sum().backward()
    optim.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    avg_before = optim.state_dict()["state"][0]["exp_avg"].clone()
    with SyncCheckpointer(small_config) as ckpt:
        handle = ckpt.save({"model": model, "optim": optim}, step=1)
        for _ in range(3):
            optim.zero_grad()
            model(torch.randn(8, 256)).sum().backward()
            optim.step()
        handle.wait()
        restored = ckpt.load()
    for key, value in before.items():
        assert torch.equal(restored["model"][key], value)
    assert torch.equal(restored["optim"]["state"][0]["exp_avg"], avg_before)
    assert not torch.equal(model.weight, before["weight"])  # training really did move on


@pytest.mark.parametrize("shared", [False, True], ids=["anonymous", "memfd"])
@pytest.mark.parametrize("populate", ["madvise", "fallback"])
def test_the_prewarm_never_changes_what_a_slab_holds(
    shared: bool, populate: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a flaky round trip: the prewarm's fallback wrote a zero into each page while
    (or after) a capture filled it. Whatever the prewarm does, a slab keeps its bytes."""
    if populate == "fallback":
        monkeypatch.setattr(arena_module, "_POPULATE_WRITE", None)
    arena = Arena(4 * 1024 * 1024, 4, shared=shared)
    try:
        pattern = torch.randint(1, 256, (arena.size,), dtype=torch.uint8)
        torch.frombuffer(arena.buffer, dtype=torch.uint8).copy_(pattern)  # a capture before the prewarm
        arena.prewarm()
        assert arena.wait_resident(30)
        assert torch.equal(torch.frombuffer(arena.buffer, dtype=torch.uint8), pattern)
    finally:
        arena.close()


def test_a_tensor_whose_storage_was_shrunk_is_refused_not_read_past_its_end(small_config: Config) -> None:
    """``untyped_storage().resize_(16)`` leaves the view as it was: capture memmoved its
    nbytes from a 16-byte allocation (heap bytes saved, or a crash)."""
    shrunk = torch.randn(1000)
    shrunk.untyped_storage().resize_(16)
    strided = torch.randn(100, 8)[:, ::2]  # a strided view: its extent is past numel (refused by the copier)
    strided.untyped_storage().resize_(100 * 8 * 4 - 8)
    with SyncCheckpointer(small_config) as ckpt:
        for name, tensor in (("shrunk", shrunk), ("view", strided)):
            with pytest.raises(UnsupportedStateError, match=f"{name}: its storage holds"):
                ckpt.save({"ok": torch.ones(2), name: tensor}, step=1)
        assert ckpt.steps() == []


def test_capture_checks_the_storage_again_when_it_copies() -> None:
    """Shrunk between the plan and the copy (another thread, while save() runs): refused by
    the copier, on both of its paths (one memmove per small piece, torch for the rest)."""
    from aiosnap.core.tensorio import host_address
    from aiosnap.trainer.capture import Copier
    from aiosnap.trainer.plan import make_plan

    small, large = torch.randn(64), torch.randn(300_000)
    plan = make_plan({"small": small, "large": large}, step=1, chunk_bytes=4 * 1024**2)
    assert host_address(small, small.nbytes) != 0
    small.untyped_storage().resize_(16)
    large.untyped_storage().resize_(16)
    assert host_address(small, small.nbytes) == 0 and host_address(small, 16) != 0
    slab = torch.empty(plan.chunks[0].nbytes, dtype=torch.uint8)
    with pytest.raises(UnsupportedStateError, match="small: its storage holds fewer bytes than its view"):
        Copier().copy(plan, plan.chunks[0], slab, None)
    small.untyped_storage().resize_(64 * 4)
    with pytest.raises(UnsupportedStateError, match="large: its storage holds fewer bytes than its view"):
        Copier().copy(plan, plan.chunks[0], slab, None)
