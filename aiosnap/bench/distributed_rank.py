"""One rank of ``aiosnap bench distributed``: ``python -m aiosnap.bench.distributed_rank PARAMS``.

Joins a gloo job, builds this rank's state of one layout (:mod:`.layouts`: FSDP, TP+FSDP2,
pipeline stages), and runs one measurement with one tool, printing its figures as one JSON
line: ``save`` (a warm-up save, then the measured one: seconds blocked in the call and
seconds until durable) or ``load`` (into the layout of this job's size, which reshards a
checkpoint saved by another number of ranks).
"""

from __future__ import annotations

import datetime
import json
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .layouts import layout_state


def run(params: dict[str, Any]) -> dict[str, Any]:
    tool, mode, world = params["tool"], params["mode"], params["world"]
    state = layout_state(params.get("layout", "fsdp"), params["size_mb"], world, zero=mode == "load")
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
