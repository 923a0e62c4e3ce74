"""Executor benchmark: ``aiosnap bench executor`` (part of ``make bench``) prints JSON.

A fresh checkpointer's first save, with ``upload.executor: thread`` and with ``process``,
side by side in one run: a model + Adam state (``--size-mb``, 256 MB by default) saved to a
local directory the moment the checkpointer exists (as a job that saves at step 0 does), a
RAM budget larger than the state. Figures per executor (median of ``--runs``, the executors
alternating): seconds to make the checkpointer (``open_s``), seconds ``save()`` blocked,
seconds to durable. The goal: the process executor's first save blocks no longer than the
thread executor's.
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

from .. import Config, SyncCheckpointer
from .local import make_state, state_tensors
from .results import add_results_option, compare, record

EXECUTORS = ("thread", "process")


def first_save(state: dict[str, Any], root: Path, executor: str, budget: int) -> dict[str, float]:
    """Make a checkpointer and save at once: how long each took (seconds)."""
    config = Config(
        storage={"url": str(root)}, ram_budget=budget, retention={"keep_last": 1},
        upload={"executor": executor}, events={"log": False},
    )  # fmt: skip
    started = time.perf_counter()
    with SyncCheckpointer(config) as ckpt:
        opened = time.perf_counter()
        handle = ckpt.save(state, step=1)
        blocked = time.perf_counter() - opened
        handle.wait()
        durable = time.perf_counter() - opened
    return {"open_s": round(opened - started, 4), "blocked_s": round(blocked, 4), "durable_s": round(durable, 4)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="aiosnap bench executor", description=__doc__)
    parser.add_argument("--size-mb", type=int, default=256, help="state size (default 256)")
    parser.add_argument("--runs", type=int, default=3, help="runs per executor (median; default 3)")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    add_results_option(parser)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, optim = make_state(args.size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in state_tensors(model, optim))
    state = {"model": model, "optim": optim}
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="aiosnap-bench-executor-"))
    runs: dict[str, list[dict[str, float]]] = {executor: [] for executor in EXECUTORS}
    try:
        for run in range(args.runs):
            for executor in EXECUTORS:
                root = base / f"{executor}-{run}"
                runs[executor].append(first_save(state, root, executor, 2 * nbytes))
                shutil.rmtree(root, ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    medians = {
        executor: {key: round(statistics.median(r[key] for r in found), 4) for key in found[0]}
        for executor, found in runs.items()
    }
    thread, process = medians["thread"], medians["process"]
    report = {
        "state_bytes": nbytes,
        "runs": runs,
        "median": medians,
        "ratios": {
            "process_blocked_over_thread": round(process["blocked_s"] / thread["blocked_s"], 2),
            "process_open_over_thread": round(process["open_s"] / thread["open_s"], 2),
        },
    }
    where = f"{nbytes / 1e6:.0f} MB, median of {args.runs}"
    record(args.results, [
        compare("executor", f"first save() blocked, upload.executor: process, {where}", process["blocked_s"], "s",
                "the thread executor's first save, same run", thread["blocked_s"], 1.0),
        compare("executor", f"checkpointer open, upload.executor: process, {where}", process["open_s"], "s",
                "the thread executor's open, same run", thread["open_s"], None),
    ])  # fmt: skip
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
