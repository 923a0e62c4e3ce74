"""Spool benchmark: ``aiosnap bench spool`` (part of ``make bench``) prints JSON.

The headline scenario: a ~512 MB model + Adam state, a 64 MiB RAM budget, an S3 target
(local moto server) throttled to 100 MB/s by a proxy, the spool on local disk. For spool
``off``, ``overflow`` and ``always`` it measures blocked time, time to durable, and the RAM
and disk high-water marks; in the same run it measures the local disk's write speed and
reports blocked(overflow) against (bytes over the RAM budget) / (disk write speed). Each
``--executors`` (default: thread and process) gets its own set of figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from .. import Config, SyncCheckpointer
from .local import make_state, state_tensors
from .s3 import _create_bucket, _endpoint

MiB = 1024 * 1024


def disk_write_mb_s(directory: Path, nbytes: int) -> float:
    """Write ``nbytes`` in 16 MiB blocks with fsync at the end, as the spool does per chunk."""
    block = os.urandom(16 * MiB)
    path = directory / "disk-speed.bin"
    started = time.perf_counter()
    with open(path, "wb") as f:
        written = 0
        while written < nbytes:
            f.write(block)
            written += len(block)
            f.flush()
            os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return written / 1e6 / seconds


def run_mode(
    url: str, bucket: str, mode: str, spool_dir: Path, model: Any, optim: Any, budget: int, executor: str
) -> dict[str, Any]:
    config = Config(
        storage={"url": f"s3://{bucket}/{executor}-{mode}"},
        ram_budget=budget,
        retention={"keep_last": 1},
        upload={"chunk_size": "16MiB", "executor": executor},
        s3={"endpoint_url": url, "addressing_style": "path", "retry_deadline": 600},
        spool={"dir": str(spool_dir), "mode": mode, "budget": "20GiB"} if mode != "off" else {},
    )
    with SyncCheckpointer(config) as ckpt:
        started = time.perf_counter()
        handle = ckpt.save({"model": model, "optim": optim}, step=1)
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
    parser.add_argument("--cap-mb-s", type=float, default=100.0)
    parser.add_argument("--spool-dir", help="spool directory (default: a temporary one)")
    parser.add_argument("--endpoint", help="an S3 endpoint URL (default: start a local moto server)")
    parser.add_argument("--executors", default="thread,process", help="upload.executor values (default both)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, optim = make_state(args.size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in state_tensors(model, optim))
    budget = args.ram_budget_mib * MiB
    spool_root = Path(args.spool_dir or tempfile.mkdtemp(prefix="aiosnap-spool-bench-"))
    spool_root.mkdir(parents=True, exist_ok=True)
    try:
        disk_speed = disk_write_mb_s(spool_root, max(nbytes - budget, 64 * MiB))
        with _endpoint(args.endpoint, args.cap_mb_s) as url:
            bucket = f"aiosnap-spool-bench-{uuid.uuid4().hex[:8]}"
            asyncio.run(_create_bucket(url, bucket))
            by_executor = {
                executor: {
                    mode: run_mode(url, bucket, mode, spool_root / executor / mode, model, optim, budget, executor)
                    for mode in ("off", "overflow", "always")
                }
                for executor in args.executors.split(",")
            }
    finally:
        if not args.spool_dir:
            shutil.rmtree(spool_root, ignore_errors=True)
    over_budget_s = max(nbytes - budget, 0) / 1e6 / disk_speed
    report = {
        "state_bytes": nbytes,
        "ram_budget_mib": args.ram_budget_mib,
        "cap_mb_s": args.cap_mb_s,
        "disk_write_mb_s": round(disk_speed, 1),
        "disk_floor_s": round(over_budget_s, 3),
        "executors": {
            executor: {
                "modes": modes,
                "ratios": {
                    "blocked_overflow_over_off": round(modes["overflow"]["blocked_s"] / modes["off"]["blocked_s"], 3),
                    "blocked_overflow_over_disk_floor": round(modes["overflow"]["blocked_s"] / over_budget_s, 2),
                    "blocked_always_over_disk_floor": round(
                        modes["always"]["blocked_s"] / (nbytes / 1e6 / disk_speed), 2
                    ),
                },
            }
            for executor, modes in by_executor.items()
        },
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
