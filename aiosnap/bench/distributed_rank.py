"""One rank of ``aiosnap bench distributed``: ``python -m aiosnap.bench.distributed_rank PARAMS``.

Joins a gloo job, builds a sharded state (``Shard(0)`` DTensors over a 1-D mesh of every
rank, plus a small replicated part), and runs one measurement with one tool, printing its
figures as one JSON line: ``save`` (a warm-up save, then the measured one: seconds blocked
in the call and seconds until durable) or ``load`` (into DTensors of this job's mesh, which
reshards a checkpoint saved by another number of ranks).
"""

from __future__ import annotations

import datetime
import json
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

MiB = 1024 * 1024
TENSORS = 8
COLUMNS = 1024


def sharded_state(size_mb: int, world: int, zero: bool = False) -> dict[str, Any]:
    """``size_mb`` MB of float32 in :data:`TENSORS` row-sharded DTensors, and a replicated part."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rows = max(world, size_mb * MiB // 4 // COLUMNS // TENSORS)
    generator = torch.Generator().manual_seed(dist.get_rank())
    model: dict[str, Any] = {}
    for index in range(TENSORS):
        local_rows = rows // world + (1 if dist.get_rank() < rows % world else 0)
        local = torch.zeros(local_rows, COLUMNS) if zero else torch.randn(local_rows, COLUMNS, generator=generator)
        model[f"layer{index}.weight"] = DTensor.from_local(
            local, mesh, [Shard(0)], shape=torch.Size([rows, COLUMNS]), stride=(COLUMNS, 1)
        )
    model["norm.weight"] = torch.zeros(64, COLUMNS) if zero else torch.ones(64, COLUMNS)  # replicated
    return {"model": model, "step": 0}


def run(params: dict[str, Any]) -> dict[str, Any]:
    tool, mode, world = params["tool"], params["mode"], params["world"]
    state = sharded_state(params["size_mb"], world, zero=mode == "load")
    if tool == "aiosnap":
        from .. import Config, SyncCheckpointer

        config = Config(
            storage={"url": params["url"]},
            ram_budget=f"{params['ram_budget_mib']}MiB",
            retention={"keep_last": None},
            events={"log": False},
            s3=params.get("s3") or {},
        )
        with SyncCheckpointer(config) as ckpt:
            if mode == "save":
                ckpt.save(state, step=1).wait()
                dist.barrier()  # every rank starts the measured save together (as for DCP)
                started = time.perf_counter()
                handle = ckpt.save(state, step=2)
                blocked = time.perf_counter() - started
                result = handle.wait()
                durable = time.perf_counter() - started
                return {"blocked_s": blocked, "durable_s": durable, "capture_s": result.stage_seconds["capture"]}
            dist.barrier()
            started = time.perf_counter()
            ckpt.load(state, step=2)
            return {"load_s": time.perf_counter() - started}
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import async_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "save":
            warm: Any = async_save(state, checkpoint_id=f"{params['url']}/warm")
            warm.result()
            dist.barrier()
            started = time.perf_counter()
            future: Any = async_save(state, checkpoint_id=f"{params['url']}/measured")
            blocked = time.perf_counter() - started
            future.result()
            return {"blocked_s": blocked, "durable_s": time.perf_counter() - started}
        dist.barrier()
        started = time.perf_counter()
        dcp_load(state, checkpoint_id=f"{params['url']}/measured")
        return {"load_s": time.perf_counter() - started}


def main(measure: Callable[[dict[str, Any]], dict[str, Any]] = run) -> None:
    """Join the gloo job ``sys.argv[1]`` describes, print ``measure(params)`` as one JSON line."""
    params = json.loads(sys.argv[1])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{params['port']}", rank=params["rank"], world_size=params["world"],
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    try:
        print(json.dumps(measure(params)), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
