"""A resumed run continues exactly like an uninterrupted one."""

from __future__ import annotations

import random

import pytest
import torch
from aiosnap import Config, RNGState, SyncCheckpointer
from tests.conftest import make_model

pytestmark = pytest.mark.both_executors


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = make_model(seed=123)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)
    return model, optim, sched


def _train(
    model: torch.nn.Module, optim: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, steps: int
) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 16)  # data drawn from the RNG: resumed RNG must match
        noise = random.random()
        loss = ((model(torch.nn.functional.dropout(x, 0.1)) - noise) ** 2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        losses.append(loss.item())
    return losses


def test_resume_gives_the_same_loss_sequence(small_config: Config) -> None:
    torch.manual_seed(7)
    random.seed(7)
    model, optim, sched = _fresh()
    first = _train(model, optim, sched, 10)
    with SyncCheckpointer(small_config) as ckpt:
        ckpt.save({"model": model, "optim": optim, "sched": sched, "rng": RNGState()}, step=10).wait()
    uninterrupted = _train(model, optim, sched, 10)

    torch.manual_seed(999)  # a new process would start elsewhere
    random.seed(999)
    model2, optim2, sched2 = _fresh()
    with SyncCheckpointer(small_config) as ckpt:
        ckpt.load({"model": model2, "optim": optim2, "sched": sched2, "rng": RNGState()})
    resumed = _train(model2, optim2, sched2, 10)
    assert len(first) == 10
    assert resumed == uninterrupted
    assert sched2.get_last_lr() == sched.get_last_lr()
