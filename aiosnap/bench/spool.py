"""Spool benchmark: ``aiosnap bench spool`` (part of ``make bench``) prints JSON.

The headline scenario: a ~512 MB model + Adam state, a 64 MiB RAM budget, an S3 target
(local moto server) throttled to 100 MB/s by a proxy, the spool on local disk. For spool
``off``, ``overflow`` and ``always`` it measures blocked time, time to durable, and the RAM
and disk high-water marks. It measures the disk floor itself, in the spill's own write
pattern: the bytes over the RAM budget written to the same disk as new files of the spill's
chunk size (``--chunk-mib``), each fsynced. A disk's speed drifts by 3x and more between
bursts (host caches filling and draining), so the floor and the ``overflow`` save alternate:
``--rounds`` rounds, each one floor run then one overflow save per executor, and the figure
is the median of the rounds' blocked times over the median of their floors (the goal: at
most 1.5x); ``off`` and ``always`` run once, after the rounds. Each ``--executors`` (default:
thread and process) gets its own set of figures; ``--results PATH`` appends the overflow
rows for the closing table (:mod:`.results`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from .. import Config, SyncCheckpointer
from ..core import durable
from .local import make_state, state_tensors
from .results import add_results_option, compare, record
from .s3 import _create_bucket, _endpoint

MiB = 1024 * 1024


def spill_floor_s(directory: Path, nbytes: int, file_bytes: int, runs: int) -> float:
    """The disk floor of a spill, measured: ``nbytes`` written the way the spool writes them
    (one new file per chunk of ``file_bytes``, each written once and fsynced) on the same
    disk; the median of ``runs`` runs, the files removed between runs (untimed)."""
    block = memoryview(os.urandom(file_bytes))
    seconds: list[float] = []
    for run in range(runs):
        folder = directory / f"disk-floor-{run}"
        folder.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        written = index = 0
        while written < nbytes:
            part = block[: min(file_bytes, nbytes - written)]
            durable.write_file(folder / f"{index}.bin", part)
            written += len(part)
            index += 1
        seconds.append(time.perf_counter() - started)
        shutil.rmtree(folder)
    return statistics.median(seconds)


def run_mode(
    url: str, bucket: str, mode: str, spool_dir: Path, state: dict[str, Any], budget: int, executor: str, chunk: int
) -> dict[str, Any]:
    config = Config(
        storage={"url": f"s3://{bucket}/{executor}-{mode}-{uuid.uuid4().hex[:8]}"},
        ram_budget=budget,
        retention={"keep_last": 1},
        upload={"chunk_size": chunk, "executor": executor},
        s3={"endpoint_url": url, "addressing_style": "path", "retry_deadline": 600},
        spool={"dir": str(spool_dir), "mode": mode, "budget": "20GiB"} if mode != "off" else {},
    )
    with SyncCheckpointer(config) as ckpt:
        started = time.perf_counter()
        handle = ckpt.save(state, step=1)
        blocked = time.perf_counter() - started
        result = handle.wait()
        spool = ckpt._engine.spool
        disk_high_water = 0 if spool is None else spool.budget.high_water
    return {
        "blocked_s": round(blocked, 3),
        "durable_s": round(result.durable_s, 3),
        "ram_high_water_mib": round(result.ram_high_water / MiB, 1),
        "disk_high_water_mib": round(disk_high_water / MiB, 1),
        "spooled_chunks": result.spooled_chunks,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="aiosnap bench spool", description=__doc__)
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--ram-budget-mib", type=int, default=64)
    parser.add_argument("--chunk-mib", type=int, default=16, help="upload.chunk_size: the spill's file size (16)")
    parser.add_argument("--cap-mb-s", type=float, default=100.0)
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of a disk floor run then an overflow save (median; default 3)"
    )
    parser.add_argument("--spool-dir", help="spool directory (default: a temporary one)")
    parser.add_argument("--endpoint", help="an S3 endpoint URL (default: start a local moto server)")
    parser.add_argument("--executors", default="thread,process", help="upload.executor values (default both)")
    parser.add_argument("--modes", default="off,overflow,always", help="spool modes to run (default all three)")
    add_results_option(parser)
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if "overflow" not in modes:
        parser.error("--modes must include overflow (the headline figure)")
    torch.manual_seed(0)
    model, optim = make_state(args.size_mb)
    state = {"model": model, "optim": optim}
    nbytes = sum(t.numel() * t.element_size() for t in state_tensors(model, optim))
    budget, chunk = args.ram_budget_mib * MiB, args.chunk_mib * MiB
    over_budget = max(nbytes - budget, chunk)
    spool_root = Path(args.spool_dir or tempfile.mkdtemp(prefix="aiosnap-spool-bench-"))
    spool_root.mkdir(parents=True, exist_ok=True)
    floors: list[float] = []
    executors = [e for e in args.executors.split(",") if e]
    by_executor: dict[str, dict[str, Any]] = {executor: {} for executor in executors}
    overflow: dict[str, list[dict[str, Any]]] = {executor: [] for executor in executors}
    try:
        with _endpoint(args.endpoint, args.cap_mb_s) as url:
            bucket = f"aiosnap-spool-bench-{uuid.uuid4().hex[:8]}"
            asyncio.run(_create_bucket(url, bucket))
            for round_ in range(max(1, args.rounds)):  # the floor and the spill side by side
                floors.append(spill_floor_s(spool_root, over_budget, chunk, 1))
                for executor in executors:
                    folder = spool_root / executor / f"overflow-{round_}"
                    overflow[executor].append(run_mode(url, bucket, "overflow", folder, state, budget, executor, chunk))
            for executor in executors:
                by_executor[executor]["overflow"] = _median_run(overflow[executor])
                for mode in (m for m in modes if m != "overflow"):
                    folder = spool_root / executor / mode
                    by_executor[executor][mode] = run_mode(url, bucket, mode, folder, state, budget, executor, chunk)
    finally:
        if not args.spool_dir:
            shutil.rmtree(spool_root, ignore_errors=True)
    floor_s = statistics.median(floors)
    whole_floor_s = floor_s * nbytes / over_budget
    report = {
        "state_bytes": nbytes,
        "ram_budget_mib": args.ram_budget_mib,
        "chunk_mib": args.chunk_mib,
        "cap_mb_s": args.cap_mb_s,
        "over_budget_bytes": over_budget,
        "disk_floor_s": round(floor_s, 3),
        "rounds": [
            {"disk_floor_s": round(f, 3), **{e: overflow[e][i]["blocked_s"] for e in executors}}
            for i, f in enumerate(floors)
        ],
        "disk_write_mb_s": round(over_budget / 1e6 / floor_s, 1),
        "executors": {executor: {"modes": found, "ratios": _ratios(found, floor_s, whole_floor_s)}
                      for executor, found in by_executor.items()},
    }  # fmt: skip
    figures = [
        compare(
            "spool",
            f"spool overflow: save() blocked, {executor} executor, {nbytes / 1e6:.0f} MB, "
            f"{args.ram_budget_mib} MiB budget, S3 at {args.cap_mb_s:g} MB/s",
            found["overflow"]["blocked_s"],
            "s",
            f"disk floor: {over_budget / 1e6:.0f} MB over budget as fsynced {args.chunk_mib} MiB files, "
            f"median of {len(floors)} rounds alternating with the save",
            floor_s,
            1.5,
        )
        for executor, found in by_executor.items()
    ]
    record(args.results, figures)
    print(json.dumps(report, indent=2))
    return report


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose blocked time is the median of ``runs`` (the lower one of an even count)."""
    ordered = sorted(runs, key=lambda r: r["blocked_s"])
    return {**ordered[(len(ordered) - 1) // 2], "blocked_s_each": [r["blocked_s"] for r in runs]}


def _ratios(found: dict[str, dict[str, Any]], floor_s: float, whole_floor_s: float) -> dict[str, float]:
    ratios = {"blocked_overflow_over_disk_floor": round(found["overflow"]["blocked_s"] / floor_s, 2)}
    if "off" in found:
        ratios["blocked_overflow_over_off"] = round(found["overflow"]["blocked_s"] / found["off"]["blocked_s"], 3)
    if "always" in found:  # every byte goes to disk: its floor is the whole state's
        ratios["blocked_always_over_disk_floor"] = round(found["always"]["blocked_s"] / whole_floor_s, 2)
    return ratios


if __name__ == "__main__":
    main()
