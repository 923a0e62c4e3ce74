"""Benchmark of DCP through aiosnap: ``aiosnap bench dcp`` prints JSON figures.

One state (``--size-mb`` of float32 tensors, a model's and its Adam moments' shape), one run
per tool, each in a fresh process (a clean peak RSS):

Each tool's writer and reader are made before the clock starts (aiosnap's shared loop, slab
pool and storage client with them), as a training job makes them once.

- local disk: ``dcp.async_save`` (THREAD) with torch's ``FileSystemWriter`` and with
  ``aiosnap.dcp.StorageWriter`` (DCP's default stager), and with aiosnap's writer and
  ``aiosnap.dcp.Stager`` (reused, budgeted staging buffers): how long ``async_save``
  blocks, how long until the checkpoint is durable, the peak RSS increase; then ``dcp.load``
  of the checkpoint with torch's ``FileSystemReader`` and with aiosnap's ``StorageReader``;
- on the S3 test server (moto, on loopback; ``--s3``): aiosnap's writer and reader, and
  ``s3torchconnector``'s DCP writer and reader (its ``S3StorageWriter``/``S3StorageReader``
  take no endpoint, so their file system is replaced by one whose client has the test
  server's; when the package is not installed the report says so).

Ratios: aiosnap's figure over torch's (the goal: at most 1 on every figure). Run it on a
quiet machine: the development machine's 2 shared cores make single runs noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

MiB = 1024 * 1024


def _state(size_mb: int) -> dict[str, Any]:
    width = 1024
    rows = max(1, size_mb * MiB // 3 // (width * 4) // 8)
    generator = torch.Generator().manual_seed(0)
    layers = {f"layers.{i}.weight": torch.randn(rows, width, generator=generator) for i in range(8)}
    return {
        "model": layers,
        "optim": {k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)} for k, v in layers.items()},
        "step": 100,
    }


def _zeros(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _zeros(v) for k, v in value.items()}
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else value


def _s3tc_filesystem(config: dict[str, Any]) -> Any:
    """s3torchconnector's DCP file system on the test server (path-style addressing)."""
    from s3torchconnector._s3client import S3Client, S3ClientConfig
    from s3torchconnector.dcp import S3FileSystem

    client = S3Client(
        "us-east-1", endpoint=config["s3"]["endpoint_url"], s3client_config=S3ClientConfig(force_path_style=True)
    )
    return S3FileSystem("us-east-1", s3_client=client)


def _writer(tool: str, url: str, config: dict[str, Any]) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    if tool == "torch":
        return FileSystemWriter(url)
    if tool == "s3torchconnector":
        from s3torchconnector.dcp import S3StorageWriter

        writer = S3StorageWriter(region="us-east-1", path=url)
        writer.fs = _s3tc_filesystem(config)  # its DCP writer takes no endpoint: its file system does
        return writer
    import aiosnap.dcp

    return aiosnap.dcp.StorageWriter(url, config)


def _reader(tool: str, url: str, config: dict[str, Any]) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    if tool == "torch":
        return FileSystemReader(url)
    if tool == "s3torchconnector":
        from s3torchconnector.dcp import S3StorageReader

        reader = S3StorageReader(region="us-east-1", path=url)
        reader.fs = _s3tc_filesystem(config)
        return reader
    import aiosnap.dcp

    return aiosnap.dcp.StorageReader(url, config)


def child(tool: str, url: str, size_mb: int, config: dict[str, Any], stager: bool) -> dict[str, Any]:
    """One tool's save and load, in this (fresh) process."""
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, async_save

    from .local import PeakRSS

    warnings.simplefilter("ignore")
    state = _state(size_mb)
    extra: dict[str, Any] = {}
    if stager:
        import aiosnap.dcp

        extra["async_stager"] = aiosnap.dcp.Stager(config)
    writer, reader = _writer(tool, url, config), _reader(tool, url, config)
    if tool == "aiosnap":  # made before the clock starts, as a training job makes them once
        from ..interop.dcp.runtime import runtime

        runtime().pool(writer.config)
        runtime().run(writer.storage.connect())
    with PeakRSS() as save_rss:
        started = time.perf_counter()
        future: Any = async_save(
            state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.THREAD, no_dist=True, **extra
        )  # fmt: skip
        blocked = time.perf_counter() - started
        future = getattr(future, "upload_completion", future)
        future.result()
        durable = time.perf_counter() - started
    if stager:
        extra["async_stager"].close()
    target = _zeros(state)
    with PeakRSS() as load_rss:
        started = time.perf_counter()
        load(target, storage_reader=reader, no_dist=True)
        loaded = time.perf_counter() - started
    equal = all(torch.equal(target["model"][k], v) for k, v in state["model"].items())
    return {
        "blocked_s": round(blocked, 3), "durable_s": round(durable, 3),
        "save_peak_rss_mib": round((save_rss.increase or 0) / MiB, 1), "load_s": round(loaded, 3),
        "load_peak_rss_mib": round((load_rss.increase or 0) / MiB, 1), "values_equal": equal,
    }  # fmt: skip


def _run(tool: str, url: str, size_mb: int, config: dict[str, Any], stager: bool = False) -> dict[str, Any]:
    args = [sys.executable, "-m", "aiosnap.bench.dcp", "--child", tool, url, str(size_mb), json.dumps(config)]
    if stager:
        args.append("--stager")
    run = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if run.returncode:
        return {"error": run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit {run.returncode}"}
    figures: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return figures


def _ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    keys = ("blocked_s", "durable_s", "save_peak_rss_mib", "load_s", "load_peak_rss_mib")
    return {k: round(ours[k] / theirs[k], 2) if theirs.get(k) and k in ours else None for k in keys}


def _s3(size_mb: int, config: dict[str, Any]) -> dict[str, Any]:
    import boto3  # type: ignore[import-untyped]

    from ..testing.s3server import TEST_ENV, moto_server

    os.environ.update(TEST_ENV)
    found: dict[str, Any] = {}
    with moto_server() as endpoint:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        s3 = {**config, "s3": {"endpoint_url": endpoint, "addressing_style": "path"}}
        found["aiosnap"] = _run("aiosnap", "s3://bench/aiosnap", size_mb, s3)
        try:
            import s3torchconnector  # noqa: F401
        except ImportError:
            found["s3torchconnector"] = {"skipped": "s3torchconnector is not installed (pip install s3torchconnector)"}
        else:
            found["s3torchconnector"] = _run("s3torchconnector", "s3://bench/s3tc", size_mb, s3)
        if "blocked_s" in found.get("s3torchconnector", {}):
            found["ratios_aiosnap_over_s3torchconnector"] = _ratios(found["aiosnap"], found["s3torchconnector"])
    return found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="aiosnap bench dcp", description=__doc__)
    parser.add_argument("--size-mb", type=int, default=500, help="state size in MB (default 500)")
    parser.add_argument("--ram-budget", default="1GiB", help="aiosnap's RAM budget (default 1GiB)")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--s3", action="store_true", help="also on the S3 test server (moto)")
    parser.add_argument("--child", nargs=4, metavar=("TOOL", "URL", "SIZE", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--stager", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        tool, url, size, config = args.child
        figures = child(tool, url, int(size), json.loads(config), args.stager)
        print(json.dumps(figures))
        return figures
    config = {"ram_budget": args.ram_budget, "events": {"log": False}}
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="aiosnap-bench-dcp-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        local = {
            "torch_writer": _run("torch", str(folder / "torch"), args.size_mb, config),
            "aiosnap_writer": _run("aiosnap", str(folder / "aiosnap"), args.size_mb, config),
            "aiosnap_writer_and_stager": _run("aiosnap", str(folder / "staged"), args.size_mb, config, stager=True),
        }
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    report: dict[str, Any] = {"size_mb": args.size_mb, "ram_budget": args.ram_budget, "local": local}
    if "blocked_s" in local["torch_writer"]:
        report["ratios_aiosnap_over_torch"] = _ratios(local["aiosnap_writer"], local["torch_writer"])
        if "blocked_s" in local["aiosnap_writer_and_stager"]:
            report["ratios_aiosnap_with_stager_over_torch"] = _ratios(
                local["aiosnap_writer_and_stager"], local["torch_writer"]
            )
    if args.s3:
        report["s3"] = _s3(args.size_mb, config)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
