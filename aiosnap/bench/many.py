"""Benchmark of saves of many small tensors: ``aiosnap bench many`` prints JSON figures.

A state of ``--tensors`` tensors of ``--floats`` float32 values each (1 KB by default), the
shape of a large MoE model's or a per-parameter optimizer's state. In one process, on one
local disk, each tool saves it ``--saves`` times, the values changing in place between saves
as training changes them:

- ``aiosnap``: how long ``save()`` blocks (the first save, then the median of the warm
  ones, which reuse the first save's layout) and how long until durable;
- ``torch.save`` of the same dict (the caller blocks for all of it);
- DCP ``async_save`` (thread executor, no process group): how long it blocks.

Ratios: aiosnap's warm blocked time over ``torch.save`` (the goal: at most 0.25) and over
DCP's blocked time; and the blocked microseconds per tensor.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch


def _state(tensors: int, floats: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"layer{i // 8}.expert{i % 8}": torch.randn(floats, generator=generator) for i in range(tensors)}


def _train(state: dict[str, torch.Tensor]) -> None:
    torch._foreach_add_(list(state.values()), 0.001)


def _aiosnap(folder: Path, state: dict[str, torch.Tensor], saves: int) -> dict[str, Any]:
    from .. import Config, SyncCheckpointer

    blocked, durable = [], []
    config = Config(storage={"url": str(folder / "aiosnap")}, events={"log": False}, retention={"keep_last": 2})
    with SyncCheckpointer(config) as ckpt:
        for step in range(saves + 1):
            _train(state)
            started = time.perf_counter()
            handle = ckpt.save(state, step=step)
            blocked.append(time.perf_counter() - started)
            handle.wait()
            durable.append(time.perf_counter() - started)
        check = ckpt.load()
    ok = all(torch.equal(check[name], tensor) for name, tensor in state.items())
    return {
        "first_blocked_s": round(blocked[0], 3),
        "blocked_s": round(statistics.median(blocked[1:]), 3),
        "blocked_runs_s": [round(b, 3) for b in blocked[1:]],
        "durable_s": round(statistics.median(durable[1:]), 3),
        "values_equal": ok,
    }


def _torch_save(folder: Path, state: dict[str, torch.Tensor], saves: int) -> dict[str, Any]:
    seconds = []
    for _ in range(saves):
        _train(state)
        started = time.perf_counter()
        torch.save(state, folder / "torch.pt")
        seconds.append(time.perf_counter() - started)
    return {"blocked_s": round(statistics.median(seconds), 3), "blocked_runs_s": [round(s, 3) for s in seconds]}


def _dcp_async_save(folder: Path, state: dict[str, torch.Tensor], saves: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict_saver import async_save

    blocked, durable = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index in range(saves):
            _train(state)
            started = time.perf_counter()
            future: Any = async_save(state, checkpoint_id=str(folder / f"dcp{index}"))
            blocked.append(time.perf_counter() - started)
            future.result()
            durable.append(time.perf_counter() - started)
    return {
        "blocked_s": round(statistics.median(blocked), 3),
        "blocked_runs_s": [round(b, 3) for b in blocked],
        "durable_s": round(statistics.median(durable), 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="aiosnap bench many", description=__doc__)
    parser.add_argument("--tensors", type=int, default=40_000, help="tensors in the state (default 40000)")
    parser.add_argument("--floats", type=int, default=256, help="float32 values per tensor (default 256: 1 KB)")
    parser.add_argument("--saves", type=int, default=5, help="measured saves per tool (default 5)")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="aiosnap-bench-many-"))
    folder.mkdir(parents=True, exist_ok=True)
    state = _state(args.tensors, args.floats)
    try:
        ours = _aiosnap(folder, state, args.saves)
        torch_figures = _torch_save(folder, state, args.saves)
        dcp = _dcp_async_save(folder, state, max(1, args.saves // 2))
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    report = {
        "tensors": args.tensors,
        "bytes_per_tensor": args.floats * 4,
        "aiosnap": ours,
        "torch_save": torch_figures,
        "dcp_async_save": dcp,
        "ratios": {
            "aiosnap_blocked_over_torch_save": round(ours["blocked_s"] / torch_figures["blocked_s"], 2),
            "aiosnap_blocked_over_dcp_blocked": round(ours["blocked_s"] / dcp["blocked_s"], 2),
        },
        "aiosnap_blocked_us_per_tensor": round(ours["blocked_s"] / args.tensors * 1e6, 2),
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
