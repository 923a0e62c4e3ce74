"""S3 benchmark: ``aiosnap bench s3`` (part of ``make bench``) prints JSON.

Against a local S3 protocol server (moto, started here unless ``--endpoint`` is given),
optionally throttled by a fault proxy (``--cap-mb-s``), measures in one run:

- aiosnap: blocked seconds, seconds to durable, upload throughput, restore throughput;
- the baseline a user would otherwise write: ``torch.save`` into a buffer, then one
  ``put_object`` (and ``get_object`` + ``torch.load`` to restore), blocking all along;
- ratios of the two, and of the throughput against the cap; with a cap, the time to
  durable of this fresh checkpointer's first save over the bandwidth floor (the bytes at the
  cap), which ``--results PATH`` appends for the closing table (the goal: at most 1.1x).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from .. import Config, SyncCheckpointer
from .local import make_state, state_tensors
from .results import add_results_option, compare, record

MiB = 1024 * 1024


@contextlib.contextmanager
def _endpoint(url: str | None, cap_mb_s: float | None) -> Iterator[str]:
    with contextlib.ExitStack() as stack:
        if url is None:
            from ..testing.s3server import TEST_ENV, moto_server

            for key, value in TEST_ENV.items():
                os.environ.setdefault(key, value)
            url = stack.enter_context(moto_server())
        if cap_mb_s:
            from ..testing.faultproxy import FaultProxy

            proxy = FaultProxy(int(url.rsplit(":", 1)[1]))
            stack.callback(proxy.close)
            proxy.set_rate(cap_mb_s * 1e6)
            url = proxy.url
        yield url


def _client(url: str) -> Any:
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    config = AioConfig(s3={"addressing_style": "path"}, request_checksum_calculation="when_required")
    return get_session().create_client("s3", endpoint_url=url, config=config)


async def _create_bucket(url: str, bucket: str) -> None:
    async with _client(url) as client:
        await client.create_bucket(Bucket=bucket)


async def _baseline(url: str, bucket: str, state: dict[str, Any]) -> tuple[float, float]:
    async with _client(url) as client:
        started = time.perf_counter()
        buffer = io.BytesIO()
        torch.save(state, buffer)
        await client.put_object(Bucket=bucket, Key="baseline/state.pt", Body=buffer.getvalue())
        save_s = time.perf_counter() - started
        started = time.perf_counter()
        response = await client.get_object(Bucket=bucket, Key="baseline/state.pt")
        async with response["Body"] as body:
            data = await body.read()
        torch.load(io.BytesIO(data), weights_only=True)
        return save_s, time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="aiosnap bench s3", description=__doc__)
    parser.add_argument("--size-mb", type=int, default=200, help="state size (default 200)")
    parser.add_argument("--endpoint", help="an S3 endpoint URL (default: start a local moto server)")
    parser.add_argument("--bucket", help="bucket to use (default: a new one)")
    parser.add_argument("--cap-mb-s", type=float, help="throttle through a proxy to this many MB/s")
    parser.add_argument("--ram-budget-mib", type=int, default=512)
    add_results_option(parser)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, optim = make_state(args.size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in state_tensors(model, optim))
    with _endpoint(args.endpoint, args.cap_mb_s) as url:
        bucket = args.bucket or f"aiosnap-bench-{uuid.uuid4().hex[:8]}"
        if not args.bucket:
            asyncio.run(_create_bucket(url, bucket))
        config = Config(
            storage={"url": f"s3://{bucket}/aiosnap"},
            ram_budget=args.ram_budget_mib * MiB,
            retention={"keep_last": 1},
            s3={"endpoint_url": url, "addressing_style": "path"},
        )
        with SyncCheckpointer(config) as ckpt:
            started = time.perf_counter()
            handle = ckpt.save({"model": model, "optim": optim}, step=1)
            blocked = time.perf_counter() - started
            result = handle.wait()
            started = time.perf_counter()
            ckpt.load()
            restore_s = time.perf_counter() - started
        base_save, base_restore = asyncio.run(
            _baseline(url, bucket, {"model": model.state_dict(), "optim": optim.state_dict()})
        )
    report: dict[str, Any] = {
        "state_bytes": nbytes,
        "cap_mb_s": args.cap_mb_s,
        "aiosnap": {
            "blocked_s": round(blocked, 3),
            "durable_s": round(result.durable_s, 3),
            "upload_mb_s": round(nbytes / 1e6 / result.durable_s, 1),
            "restore_s": round(restore_s, 3),
            "restore_mb_s": round(nbytes / 1e6 / restore_s, 1),
        },
        "baseline_torch_save_put_object": {
            "blocked_s": round(base_save, 3),
            "upload_mb_s": round(nbytes / 1e6 / base_save, 1),
            "restore_s": round(base_restore, 3),
        },
        "ratios": {
            "baseline_blocked_over_aiosnap_blocked": round(base_save / blocked, 2),
            "baseline_durable_over_aiosnap_durable": round(base_save / result.durable_s, 2),
            "baseline_restore_over_aiosnap_restore": round(base_restore / restore_s, 2),
        },
    }
    if args.cap_mb_s:
        report["ratios"]["aiosnap_upload_over_cap"] = round(report["aiosnap"]["upload_mb_s"] / args.cap_mb_s, 2)
        floor = nbytes / (args.cap_mb_s * 1e6)
        report["ratios"]["aiosnap_durable_over_bandwidth_floor"] = round(result.durable_s / floor, 3)
        record(args.results, [compare(
            "s3", f"durable through a {args.cap_mb_s:g} MB/s cap, {nbytes / 1e6:.0f} MB, a fresh checkpointer's "
            "first save", result.durable_s, "s", f"bandwidth floor: the bytes at {args.cap_mb_s:g} MB/s", floor, 1.1,
        )])  # fmt: skip
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
