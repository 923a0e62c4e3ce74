"""Multi-rank benchmark: ``aiosnap bench distributed`` (part of ``make bench``) prints JSON.

Real ranks (separate processes on one gloo job, this machine) save a state of ``--size-mb``
MB in all, in each parallel layout (:mod:`.layouts`: ``fsdp`` row-sharded DTensors and a
small replicated part; ``tp_fsdp`` TP+FSDP2 on a (ranks/2, 2) mesh; ``pipeline`` one stage
per rank, distinct keys and an embedding tied across the first and last stage), with aiosnap
and with PyTorch DCP ``async_save`` (its thread executor), on the same state and local disk
in the same run; aiosnap also against the S3 test server (moto, started here; DCP has no S3
writer without extra packages). Figures per job (the slowest rank's): seconds blocked in the
save call and seconds until durable, both on a warm second save. Then 2 ranks load each
4-rank checkpoint into their own layout (a 4 -> 2 reshard: FSDP2 over 2 ranks, 2 larger
pipeline stages): aiosnap ``load`` vs DCP ``load``. Ratios aiosnap / DCP; ``--results
PATH`` appends the blocked ratios for the closing table (:mod:`.results`).

``--simulate`` runs the protocol at thousands of simulated ranks instead
(:mod:`aiosnap.bench.rank_sim`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import uuid
from typing import Any

from .layouts import LAYOUTS
from .results import add_results_option, compare, record

MiB = 1024 * 1024
GOALS = {"fsdp": 0.5}
"""The goal of blocked(aiosnap) / blocked(DCP) by layout (issue 25: the sharded state); the
other layouts' rows are in the closing table without one."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_job(world: int, module: str = "aiosnap.bench.distributed_rank", **params: Any) -> dict[str, float]:
    """Run one measurement on ``world`` ranks (``python -m module PARAMS`` each); each
    figure is the slowest rank's."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOSNAP_")}
    env["OMP_NUM_THREADS"] = "1"
    procs = []
    for rank in range(world):
        args = json.dumps({**params, "rank": rank, "world": world, "port": port})
        command = [sys.executable, "-m", module, args]
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    figures: list[dict[str, float]] = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            if proc.returncode != 0:
                what = f"{module} {params.get('tool', '')} {params.get('mode', '')}".strip()
                raise RuntimeError(f"a rank of {what} failed:\n{err[-3000:]}")
            figures.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {key: round(max(f[key] for f in figures), 3) for key in figures[0]}


def _ratio(a: float, b: float) -> float:
    return round(a / b, 2) if b else float("inf")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--simulate" in argv:  # its own options (see rank_sim)
        from .rank_sim import main as simulate

        simulated: dict[str, Any] = simulate([a for a in argv if a != "--simulate"])
        return simulated
    parser = argparse.ArgumentParser(prog="aiosnap bench distributed", description=__doc__)
    parser.add_argument("--size-mb", type=int, default=256, help="sharded state in all (default 256)")
    parser.add_argument("--ranks", default="2,4", help="job sizes to save with (default 2,4)")
    parser.add_argument("--ram-budget-mib", type=int, default=256, help="each rank's RAM budget")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="layouts to measure (default: all)")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 test server")
    parser.add_argument("--simulate", action="store_true", help="simulated ranks instead (see rank_sim)")
    add_results_option(parser)
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.ranks.split(",")]
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        parser.error(f"unknown layout(s) {unknown}: choose from {list(LAYOUTS)}")
    common = {"size_mb": args.size_mb, "ram_budget_mib": args.ram_budget_mib}
    report: dict[str, Any] = {"size_mb": args.size_mb, "save": {}, "reshard_load_4_to_2": {}, "figures": []}
    with tempfile.TemporaryDirectory(prefix="aiosnap-bench-dist-") as folder:
        for layout in layouts:
            for world in worlds:
                if layout == "tp_fsdp" and (world < 4 or world % 2):
                    continue  # a (ranks/2, 2) mesh of at least 2 x 2
                _compare(report, folder, layout, world, common)
            if 4 in worlds:
                where = {"aiosnap": f"{folder}/aiosnap-{layout}-4", "dcp": f"{folder}/dcp-{layout}-4"}
                aio = run_job(2, tool="aiosnap", mode="load", url=where["aiosnap"], layout=layout, **common)
                dcp = run_job(2, tool="dcp", mode="load", url=where["dcp"], layout=layout, **common)
                ratio = _ratio(aio["load_s"], dcp["load_s"])
                report["reshard_load_4_to_2"][layout] = {"aiosnap": aio, "dcp": dcp, "ratio": ratio}
        if not args.no_s3:
            report["save_s3"] = _s3(worlds, common)
    record(args.results, report.pop("figures"))
    print(json.dumps(report, indent=2))
    return report


def _compare(report: dict[str, Any], folder: str, layout: str, world: int, common: dict[str, Any]) -> None:
    """aiosnap and DCP saving ``layout`` on ``world`` ranks, side by side."""
    aio = run_job(world, tool="aiosnap", mode="save", url=f"{folder}/aiosnap-{layout}-{world}", layout=layout, **common)
    dcp = run_job(world, tool="dcp", mode="save", url=f"{folder}/dcp-{layout}-{world}", layout=layout, **common)
    report["save"][f"{layout}_{world}_ranks_local"] = {
        "aiosnap": aio, "dcp_async_save": dcp,
        "blocked_ratio": _ratio(aio["blocked_s"], dcp["blocked_s"]),
        "durable_ratio": _ratio(aio["durable_s"], dcp["durable_s"]),
    }  # fmt: skip
    report["figures"].append(compare(
        "distributed", f"multi-rank save() blocked, {layout}, {world} ranks, {common['size_mb']} MB in all, warm",
        aio["blocked_s"], "s", "DCP async_save (thread), same state and disk", dcp["blocked_s"],
        GOALS.get(layout),
    ))  # fmt: skip


def _s3(worlds: list[int], common: dict[str, Any]) -> dict[str, Any]:
    from .s3 import _create_bucket, _endpoint

    found: dict[str, Any] = {}
    with _endpoint(None, None) as url:
        import asyncio

        bucket = f"aiosnap-bench-{uuid.uuid4().hex[:8]}"
        asyncio.run(_create_bucket(url, bucket))
        s3 = {"endpoint_url": url, "addressing_style": "path"}
        for world in worlds:
            root = f"s3://{bucket}/ranks-{world}"
            found[f"{world}_ranks"] = run_job(world, tool="aiosnap", mode="save", url=root, s3=s3, **common)
        if 4 in worlds:
            found["reshard_load_4_to_2"] = run_job(
                2, tool="aiosnap", mode="load", url=f"s3://{bucket}/ranks-4", s3=s3, **common
            )  # fmt: skip (the fsdp layout)
    return found


if __name__ == "__main__":
    main()
