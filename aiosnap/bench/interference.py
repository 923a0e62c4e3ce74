"""Interference benchmark: ``aiosnap bench interference`` (part of ``make bench``) prints JSON.

How much a checkpoint in flight slows a Python-heavy training loop (one torch thread, many
small layers: the step is mostly interpreter time, so it feels every GIL holder). For each
method, in one process and one run, side by side:

- ``none``: no checkpoint (the noise floor of the ratio);
- ``aiosnap_thread`` / ``aiosnap_process``: ``save()`` of the state (256 MB by default)
  to the S3 test server (moto, started here) through a proxy capped at each of
  ``--cap-mb-s`` (default 100 and 40 MB/s: the whole set runs once per cap),
  with ``upload.executor`` thread or process;
- ``dcp_thread`` / ``dcp_process``: ``torch.distributed.checkpoint.async_save`` of the same
  state with its thread and its process checkpointer, to a local directory (DCP has no S3
  writer without s3fs), when torch.distributed is available.

Figures per method: ``slowdown`` (mean step time while the checkpoint is in flight over the
mean step time just before it), ``blocked_s`` (the save call) and ``durable_s`` (save call
to durable), ``other_threads_cpu_s`` (CPU time of the training process outside its
training thread from the return of the save call until durable: ``time.process_time``
less the training thread's ``time.thread_time``; an upload process's own CPU is not in
it), and ``durable_over_floor`` (bytes over cap: aiosnap only). ``--runs`` repeats
the whole set; the spread (min, max) of each figure is printed with the runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import Config, SyncCheckpointer
from .results import Figure, add_results_option, compare, record

MiB = 1024 * 1024
SERVER_NICE = 15
Done = Callable[[], bool]


def _training_loop() -> Callable[[], None]:
    """One step of a small, Python-bound model (64 tiny layers, batch 8)."""
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()) for _ in range(64)])
    optim = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(8, 32)

    def step() -> None:
        optim.zero_grad()
        model(batch).square().mean().backward()
        optim.step()

    return step


def _mean_step(step: Callable[[], None], seconds: float) -> float:
    times: list[float] = []
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.mean(times)


def _measure(step: Callable[[], None], start: Callable[[], Done], before_s: float) -> dict[str, float]:
    """Steps before the checkpoint, then steps while it is in flight until it is durable;
    and the CPU time this process spent outside this (the training) thread from the return
    of the save call to durable (the upload, not the capture): the checkpoint's threads (and
    anything else of the process), which share the GIL and the cores with training."""
    before = _mean_step(step, before_s)
    began = time.perf_counter()
    done = start()
    blocked = time.perf_counter() - began
    thread_cpu, process_cpu = time.thread_time(), time.process_time()  # the upload, not the capture
    times: list[float] = []
    while not done():
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    durable = time.perf_counter() - began
    other_cpu = (time.process_time() - process_cpu) - (time.thread_time() - thread_cpu)
    during = statistics.mean(times) if times else before
    return {
        "slowdown": round(during / before, 3), "blocked_s": round(blocked, 3), "durable_s": round(durable, 3),
        "other_threads_cpu_s": round(max(other_cpu, 0.0), 3),
    }  # fmt: skip


def _state(total_mb: int) -> dict[str, torch.Tensor]:
    per = 8 * MiB // 4  # 8 MiB tensors
    count = max(1, total_mb * MiB // (per * 4))
    return {f"t{i}": torch.randn(per) for i in range(count)}


@contextlib.contextmanager
def _s3_root(cap_mb_s: float) -> Iterator[tuple[str, str]]:
    """The S3 test server and a capped proxy to it, each in a process of its own at low CPU
    priority: they stand in for a remote store, whose work is not the trainer's to pay."""
    import asyncio

    from ..testing.faultproxy import capped_proxy_process
    from ..testing.s3server import TEST_ENV, moto_server
    from .s3 import _create_bucket

    for key, value in TEST_ENV.items():
        os.environ.setdefault(key, value)
    with (
        moto_server(nice=SERVER_NICE) as url,
        capped_proxy_process(int(url.rsplit(":", 1)[1]), cap_mb_s * 1e6, nice=SERVER_NICE) as proxy_url,
    ):
        bucket = f"interference-{uuid.uuid4().hex[:8]}"
        asyncio.run(_create_bucket(url, bucket))
        yield proxy_url, bucket


@contextlib.contextmanager
def _aiosnap(executor: str, endpoint: str, bucket: str, state: dict[str, torch.Tensor]) -> Iterator[Callable[[], Done]]:
    """A checkpointer (started before the measurement, as in a job) and its save starter."""
    config = Config(
        storage={"url": f"s3://{bucket}/{executor}-{uuid.uuid4().hex[:8]}"},  # a fresh root per run
        ram_budget=sum(t.numel() * 4 for t in state.values()) + 64 * MiB,
        retention={"keep_last": 1},
        upload={"executor": executor},
        s3={"endpoint_url": endpoint, "addressing_style": "path"},
    )
    steps = iter(range(1, 1_000_000))
    with SyncCheckpointer(config) as ckpt:
        ckpt.save({"warm": torch.zeros(1)}, step=next(steps)).wait()  # connections and helper up

        def start() -> Done:
            return ckpt.save(state, step=next(steps)).done

        yield start


@contextlib.contextmanager
def _dcp(kind: str, directory: str, state: dict[str, torch.Tensor]) -> Iterator[Callable[[], Done]]:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, async_save

    checkpointer = AsyncCheckpointerType.PROCESS if kind == "process" else AsyncCheckpointerType.THREAD
    count = iter(range(1_000_000))
    pending: list[Any] = []

    def start() -> Done:
        response = async_save(
            state, checkpoint_id=os.path.join(directory, f"{kind}-{next(count)}"), async_checkpointer_type=checkpointer
        )
        future: Any = getattr(response, "upload_completion", response)
        pending.append(future)
        done: Done = future.done
        return done

    try:
        start()()  # the first call starts DCP's background process / thread pool
        while not pending[-1].done():
            time.sleep(0.05)
        yield start
    finally:
        for future in pending:
            future.result()


def _one_run(
    args: argparse.Namespace, state: dict[str, torch.Tensor], cap_mb_s: float, endpoint: str, bucket: str
) -> dict[str, Any]:
    step = _training_loop()
    _mean_step(step, 0.5)  # warm up
    nbytes = sum(t.numel() * 4 for t in state.values())
    floor = nbytes / (cap_mb_s * 1e6)
    results: dict[str, Any] = {"none": _measure(step, lambda: _timer(args.during_s), args.before_s)}
    for executor in ("thread", "process"):
        with _aiosnap(executor, endpoint, bucket, state) as start:
            figures = _measure(step, start, args.before_s)
            figures["durable_over_floor"] = round(figures["durable_s"] / floor, 3)
            results[f"aiosnap_{executor}"] = figures
    if _dcp_available() and not args.no_dcp:
        with tempfile.TemporaryDirectory(prefix="aiosnap-bench-dcp-") as directory:
            for kind in ("thread", "process"):
                with _dcp(kind, directory, state) as start:
                    results[f"dcp_{kind}"] = _measure(step, start, args.before_s)
    return results


def _timer(seconds: float) -> Done:
    ends = time.perf_counter() + seconds
    return lambda: time.perf_counter() >= ends


def _dcp_available() -> bool:
    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint  # noqa: F401
    except ImportError:
        return False
    return bool(dist.is_available())


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    """A one-rank gloo group (DCP's process checkpointer runs collectives)."""
    import torch.distributed as dist

    if not _dcp_available() or dist.is_initialized():
        yield
        return
    from ..testing.s3server import _free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _spread(runs: list[dict[str, Any]]) -> dict[str, Any]:
    spread: dict[str, Any] = {}
    for method in runs[0]:
        spread[method] = {
            figure: [min(r[method][figure] for r in runs), max(r[method][figure] for r in runs)]
            for figure in runs[0][method]
        }
    return spread


def _median(runs: list[dict[str, Any]], method: str, figure: str) -> float:
    return float(statistics.median(r[method][figure] for r in runs))


def _figures(size_mb: int, cap_mb_s: float, runs: list[dict[str, Any]]) -> list[Figure]:
    """The closing table's rows of one rate: the process executor's slowdown (the goal),
    the trainer's CPU outside its training thread, DCP's process checkpointer beside it."""
    where = f"{size_mb} MB to S3 at {cap_mb_s:g} MB/s, median of {len(runs)}"
    noise = _median(runs, "none", "slowdown")
    rows = [
        compare(
            "interference", f"trainer step slowdown during upload, process executor, {where}",
            _median(runs, "aiosnap_process", "slowdown"), "x", "no checkpoint", None, 1.03,
            ratio=_median(runs, "aiosnap_process", "slowdown"), note=f"{cap_mb_s:g} MB/s: noise (nothing saved) "
            f"{noise:.3f}x; trainer CPU outside its training thread "
            f"{_median(runs, 'aiosnap_process', 'other_threads_cpu_s'):.3f} s (process executor), "
            f"{_median(runs, 'aiosnap_thread', 'other_threads_cpu_s'):.3f} s (thread executor)",
        ),
        compare(
            "interference", f"trainer CPU outside its training thread during upload, process executor, {where}",
            _median(runs, "aiosnap_process", "other_threads_cpu_s"), "s", "-", None, None,
        ),
    ]  # fmt: skip
    if "dcp_process" in runs[0]:
        dcp = _median(runs, "dcp_process", "slowdown")
        rows.append(compare(
            "interference", f"trainer step slowdown, DCP async_save process (local disk), {where}",
            dcp, "x", "no checkpoint", None, None, ratio=dcp,
        ))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="aiosnap bench interference", description=__doc__)
    parser.add_argument("--size-mb", type=int, default=256, help="state size (default 256)")
    parser.add_argument("--cap-mb-s", default="100,40", help="S3 throughput caps, one set per cap (default 100,40)")
    parser.add_argument("--runs", type=int, default=3, help="repetitions of the whole set (default 3)")
    parser.add_argument("--before-s", type=float, default=2.0, help="steps timed before each save (default 2)")
    parser.add_argument("--during-s", type=float, default=3.0, help="steps timed for 'none' (default 3)")
    parser.add_argument("--no-dcp", action="store_true", help="skip DCP's thread and process checkpointers")
    add_results_option(parser)
    args = parser.parse_args(argv)
    try:
        caps = [float(c) for c in args.cap_mb_s.split(",") if c]
    except ValueError:
        parser.error(f"--cap-mb-s {args.cap_mb_s!r}: comma-separated MB/s figures, such as 100,40")
    if not caps or min(caps) <= 0:
        parser.error(f"--cap-mb-s {args.cap_mb_s!r}: each cap must be a positive MB/s figure")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    state = _state(args.size_mb)
    by_rate: dict[str, Any] = {}
    figures: list[Figure] = []
    with _process_group():
        for cap in caps:
            with _s3_root(cap) as (endpoint, bucket):
                runs = [_one_run(args, state, cap, endpoint, bucket) for _ in range(args.runs)]
            by_rate[f"{cap:g}"] = {"runs": runs, "spread_min_max": _spread(runs)}
            figures.extend(_figures(args.size_mb, cap, runs))
    report = {
        "state_bytes": sum(t.numel() * 4 for t in state.values()),
        "cpus": os.cpu_count(),
        "by_cap_mb_s": by_rate,
    }
    record(args.results, figures)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
