"""Benchmark of the Lightning plugin: ``aiosnap bench lightning`` prints JSON figures.

A Lightning-shaped checkpoint (model ``state_dict`` + Adam ``optimizer_states`` + loop
counters, ~``--size-mb`` MB) is saved three times per plugin to a local directory, with
``--train-s`` seconds of (simulated, GPU-bound: the CPU is left idle) training and an update
of every parameter in between, and measured in the same run:

- ``TorchCheckpointIO`` (Lightning's default): ``torch.save``, blocking;
- ``AsyncCheckpointIO`` (Lightning's async plugin): clones every tensor on the caller's
  thread, then ``torch.save`` in a thread;
- ``AiosnapCheckpointIO``: captures into budgeted, reused host slabs, then writes.

Figures per plugin: seconds inside ``save_checkpoint`` (what training waits for, median of
the warm saves), seconds from the first save until the last is durable (``teardown``;
includes the training time), peak RSS increase.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .local import PeakRSS, make_state

MiB = 1024 * 1024


def lightning_checkpoint(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": "2.x",
        "state_dict": model.state_dict(),
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": step, "completed": step}}}},
        "callbacks": {},
        "optimizer_states": [optim.state_dict()],
        "lr_schedulers": [],
    }


def _train_step(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.999)


def run_plugin(
    plugin: Any, model: torch.nn.Module, optim: torch.optim.Optimizer, folder: Path, train_s: float
) -> dict[str, Any]:
    calls = []
    with PeakRSS() as rss:
        started = time.perf_counter()
        for step in range(3):
            began = time.perf_counter()
            plugin.save_checkpoint(lightning_checkpoint(model, optim, step), folder / f"step{step}.ckpt")
            calls.append(time.perf_counter() - began)
            _train_step(model)
            time.sleep(train_s)
        plugin.teardown()
        durable = time.perf_counter() - started
    return {
        "first_save_checkpoint_s": round(calls[0], 4),
        "warm_save_checkpoint_s": round(statistics.median(calls[1:]), 4),
        "all_durable_s": round(durable, 3),
        "peak_rss_increase_mib": None if rss.increase is None else round(rss.increase / MiB, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from lightning.pytorch.plugins import AsyncCheckpointIO, TorchCheckpointIO

    from ..integrations.lightning import AiosnapCheckpointIO

    parser = argparse.ArgumentParser(prog="aiosnap bench lightning", description=__doc__)
    parser.add_argument("--size-mb", type=int, default=300, help="checkpoint size (default 300)")
    parser.add_argument("--ram-budget-mib", type=int, default=1024)
    parser.add_argument("--train-s", type=float, default=2.0, help="training time between saves (default 2)")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="aiosnap-bench-lightning-"))
    torch.manual_seed(0)
    model, optim = make_state(args.size_mb)
    nbytes = sum(v.numel() * v.element_size() for v in model.state_dict().values()) + sum(
        t.numel() * t.element_size() for s in optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    )
    config = {"ram_budget": args.ram_budget_mib * MiB, "events": {"log": False}}
    try:
        figures = {
            "torch": run_plugin(TorchCheckpointIO(), model, optim, base / "torch", args.train_s),
            "lightning_async": run_plugin(
                AsyncCheckpointIO(TorchCheckpointIO()), model, optim, base / "async", args.train_s
            ),
            "aiosnap": run_plugin(AiosnapCheckpointIO(config), model, optim, base / "aiosnap", args.train_s),
        }
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    ours = figures["aiosnap"]["warm_save_checkpoint_s"]
    report = {
        "checkpoint_bytes": nbytes,
        "train_s_between_saves": args.train_s,
        **figures,
        "ratios": {
            "torch_over_aiosnap_warm_save": round(figures["torch"]["warm_save_checkpoint_s"] / ours, 2),
            "async_over_aiosnap_warm_save": round(figures["lightning_async"]["warm_save_checkpoint_s"] / ours, 2),
        },
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
