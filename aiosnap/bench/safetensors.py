"""Safetensors benchmark: ``aiosnap bench safetensors`` prints JSON.

Real ranks (separate processes on one gloo job, this machine) hold a row-sharded state of
``--size-mb`` MB (the state of ``aiosnap bench distributed``), saved once with aiosnap.
Then, on the same state, in one run (each figure the slowest rank's):

- **export to local disk**: ``aiosnap.export`` from every rank (consolidated shards written
  in parallel, no staging) vs PyTorch DCP's ``HuggingFaceStorageWriter`` with
  ``save_distributed`` and ``enable_consolidation`` (every rank writes its sharded files,
  then they are consolidated into full tensors): seconds until the folder is complete;
- **export to S3**: ``aiosnap.export`` to the S3 test server (moto, started here) through a
  fault proxy capped at ``--cap-mb-s``: seconds until durable, over the bandwidth floor
  (bytes / cap); DCP has no S3 writer;
- **import into DTensors**: load the exported folder into the ranks' DTensors, aiosnap
  (``SafetensorsFolder``, ranged reads of each rank's rows) vs DCP's ``HuggingFaceStorageReader``.

Goals (issue 23): S3 durable <= 1.15x the floor; local <= 0.5x DCP's write + consolidation;
import <= DCP's reader.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from typing import Any

MiB = 1024 * 1024


def _rank(params: dict[str, Any]) -> dict[str, Any]:
    """One rank: save, export (aiosnap local, DCP local, aiosnap S3), import (both)."""
    import torch.distributed as dist

    from .. import Config, SyncCheckpointer
    from ..interop.safetensors.api import export
    from ..interop.safetensors.reader import SafetensorsFolder
    from ..storage.local import LocalStorage
    from .layouts import layout_state

    work, world = params["work"], params["world"]
    state = layout_state("fsdp", params["size_mb"], world)
    config = Config(
        storage={"url": f"{work}/aiosnap"}, ram_budget=f"{params['ram_budget_mib']}MiB",
        retention={"keep_last": None}, events={"log": False},
        s3={"endpoint_url": params["endpoint"], "addressing_style": "path"},
    )  # fmt: skip
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(state, step=1).wait()
    figures: dict[str, Any] = {}

    def timed(name: str, work_: Any) -> None:
        dist.barrier()
        started = time.perf_counter()
        work_()
        dist.barrier()
        figures[name] = time.perf_counter() - started

    timed("aiosnap_local_s", lambda: export(f"{work}/aiosnap", f"{work}/hf_aiosnap", config=config, paths=["model/*"]))
    timed("aiosnap_s3_s", lambda: export(f"{work}/aiosnap", f"s3://{params['bucket']}/hf", config=config,
                                         paths=["model/*"]))  # fmt: skip

    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        writer = HuggingFaceStorageWriter(f"{work}/hf_dcp", save_distributed=True, enable_consolidation=True)
        timed("dcp_local_s", lambda: dcp_save(state["model"], storage_writer=writer))

    targets = layout_state("fsdp", params["size_mb"], world, zero=True)["model"]
    folder = SafetensorsFolder(LocalStorage(f"{work}/hf_aiosnap"))
    with SyncCheckpointer(config, storage=folder) as ckpt:
        timed("aiosnap_import_s", lambda: ckpt.load({"model": targets}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timed("dcp_import_s", lambda: dcp_load(targets, storage_reader=HuggingFaceStorageReader(f"{work}/hf_aiosnap")))
    return figures


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="aiosnap bench safetensors", description=__doc__)
    parser.add_argument("--size-mb", type=int, default=256, help="state size in all (default 256)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the job (default 2)")
    parser.add_argument("--cap-mb-s", type=float, default=100.0, help="S3 bandwidth cap (default 100 MB/s)")
    parser.add_argument("--ram-budget-mib", type=int, default=256)
    args = parser.parse_args(argv)
    from .distributed import run_job
    from .s3 import _create_bucket, _endpoint

    work = tempfile.mkdtemp(prefix="aiosnap-bench-safetensors-")
    try:
        with _endpoint(None, args.cap_mb_s) as url:
            import asyncio

            bucket = f"aiosnap-bench-{uuid.uuid4().hex[:8]}"
            asyncio.run(_create_bucket(url, bucket))
            figures = run_job(
                args.ranks, module="aiosnap.bench.safetensors", work=work, size_mb=args.size_mb, endpoint=url,
                bucket=bucket, ram_budget_mib=args.ram_budget_mib,
            )  # fmt: skip
        nbytes = sum(os.path.getsize(os.path.join(work, "hf_aiosnap", f)) for f in os.listdir(f"{work}/hf_aiosnap"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    floor = nbytes / (args.cap_mb_s * 1e6)
    s = figures
    report = {
        "ranks": args.ranks,
        "exported_bytes": nbytes,
        "cap_mb_s": args.cap_mb_s,
        "seconds": figures,
        "ratios": {
            "s3_durable_over_floor": round(s["aiosnap_s3_s"] / floor, 2),
            "local_aiosnap_over_dcp_write_and_consolidate": round(s["aiosnap_local_s"] / s["dcp_local_s"], 2),
            "import_aiosnap_over_dcp_reader": round(s["aiosnap_import_s"] / s["dcp_import_s"], 2),
        },
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):  # one rank of the job
        from .distributed_rank import main as rank_main

        rank_main(_rank)
    else:
        main()
