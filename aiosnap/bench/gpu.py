"""GPU benchmark: ``aiosnap bench gpu`` (part of ``make gpu-check``) prints one table.

Device-to-host staging of a state of CUDA tensors (``--size-mib``, float32 and one bfloat16
tensor of an odd length) saved ``--saves`` times to local disk, each tool in a fresh process
on the same GPU, the tensors changed on the GPU between saves as training would:

- ``floor``: copies into preallocated, touched pinned buffers (``non_blocking`` copies, then
  ``torch.cuda.synchronize()``): the least any snapshot can block training;
- ``aiosnap``: ``SyncCheckpointer.save()`` with a RAM budget above the state (its staging
  slabs are pinned for CUDA): blocked until ``save()`` returned (every byte copied), durable
  at ``handle.wait()``; afterwards every tensor is loaded back and compared;
- ``dcp_pinned``: DCP ``async_save`` with its own pinned stager (``DefaultStager``: pinned
  memory, non-blocking copies, staging before ``async_save`` returns), one stager reused for
  every save as DCP advises: blocked until ``async_save`` returned, durable at the future.

Figures per tool: the first save and the warm ones (median), blocked and durable seconds,
D2H rate (state bytes / blocked seconds, GiB/s) and the peak host RSS increase over the
saves (VmHWM: pinned staging counts; aiosnap's check of the values comes after, outside it).
Each row is printed as soon as its tool is done; ``--json`` prints the figures as JSON at the
end instead. All tools together get ``--budget-s`` seconds, shared out as they go (what a
quick tool leaves is the next ones'). Exit status 1 when any tool failed or ran out of time
(its row says why); without a CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import Config, SyncCheckpointer
from .local import PeakRSS

MiB = 1024 * 1024
GiB = 1024 * MiB
TOOLS = ("floor", "aiosnap", "dcp_pinned")
BUDGET_S = 200.0
"""Seconds all tools' processes get together by default (``make gpu-check`` gives the
benchmark 230 and stays within 8 minutes)."""


def _per_tensor(size_mib: int, tensors: int) -> int:
    return max(1, size_mib * MiB // 4 // tensors)


def planned_bytes(size_mib: int, tensors: int) -> int:
    """The bytes of :func:`make_state`'s tensors, without making them."""
    per = _per_tensor(size_mib, tensors)
    return (tensors - 1) * per * 4 + (2 * per + 1) * 2


def make_state(size_mib: int, tensors: int, device: str = "cuda") -> dict[str, torch.Tensor]:
    """``tensors`` tensors on ``device`` of ~``size_mib`` MiB in all: float32 ones and a
    bfloat16 one of an odd length (bf16 of odd lengths is what torchsnapshot once truncated)."""
    per = _per_tensor(size_mib, tensors)
    generator = torch.Generator(device=device).manual_seed(0)
    state = {f"w{i}": torch.randn(per, device=device, generator=generator) for i in range(tensors - 1)}
    state["odd_bf16"] = torch.randn(2 * per + 1, device=device, generator=generator).to(torch.bfloat16)
    _synchronize(state)
    return state


def _on_cuda(state: dict[str, torch.Tensor]) -> bool:
    return any(t.is_cuda for t in state.values())


def _synchronize(state: dict[str, torch.Tensor]) -> None:
    """Wait for the work queued on the state's device (nothing to wait for on the CPU)."""
    if _on_cuda(state):
        torch.cuda.synchronize()


def train_step(state: dict[str, torch.Tensor]) -> None:
    """Change every tensor on the GPU, then wait for it: the clock measures staging only."""
    for tensor in state.values():
        tensor.add_(1)
    _synchronize(state)


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _floor(state: dict[str, torch.Tensor], saves: int, folder: Path) -> list[tuple[float, float]]:
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=_on_cuda(state)) for k, v in state.items()}
    for buffer in pinned.values():
        buffer.zero_()  # touched: no allocation or first-touch cost in the timing
    runs = []
    for _ in range(saves):
        train_step(state)
        started = time.perf_counter()
        for key, tensor in state.items():
            pinned[key].copy_(tensor, non_blocking=True)
        _synchronize(state)
        blocked = time.perf_counter() - started
        runs.append((blocked, blocked))
    return runs


def _aiosnap(state: dict[str, torch.Tensor], saves: int, folder: Path) -> list[tuple[float, float]]:
    budget = state_bytes(state) + 256 * MiB
    config = Config(
        storage={"url": str(folder / "aiosnap")},
        ram_budget=budget,
        retention={"keep_last": 1},
        events={"log": False},
    )
    runs = []
    with SyncCheckpointer(config) as ckpt:
        for step in range(1, saves + 1):
            train_step(state)
            started = time.perf_counter()
            handle = ckpt.save(state, step=step)
            blocked = time.perf_counter() - started
            handle.wait()
            runs.append((blocked, time.perf_counter() - started))
    return runs


def _check_aiosnap(state: dict[str, torch.Tensor], folder: Path) -> None:
    """The last checkpoint holds the state's values (a full host copy of the state: after the
    measured saves, so that it is not counted in their peak RSS)."""
    with SyncCheckpointer(Config(storage={"url": str(folder / "aiosnap")}, events={"log": False})) as ckpt:
        loaded = ckpt.load()
    differ = [key for key, tensor in state.items() if not torch.equal(loaded[key], tensor.cpu())]
    if differ:
        raise RuntimeError(f"aiosnap: the checkpoint's values differ from the state saved in {differ[:4]}")


def _dcp_pinned(state: dict[str, torch.Tensor], saves: int, folder: Path) -> list[tuple[float, float]]:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import async_save

    cuda = _on_cuda(state)  # non-blocking copies need an accelerator (the CPU run is a smoke test)
    options = StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
    )
    stager = DefaultStager(options)
    runs = []
    try:
        for step in range(1, saves + 1):
            train_step(state)
            target = folder / f"dcp-{step}"
            started = time.perf_counter()
            future: Any = async_save(state, checkpoint_id=str(target), async_stager=stager)  # one process: no group
            blocked = time.perf_counter() - started
            future.result()
            runs.append((blocked, time.perf_counter() - started))
            shutil.rmtree(folder / f"dcp-{step - 1}", ignore_errors=True)  # disk for one checkpoint at a time
    finally:
        stager.close()
    return runs


MEASURE = {"floor": _floor, "aiosnap": _aiosnap, "dcp_pinned": _dcp_pinned}
CHECK = {"aiosnap": _check_aiosnap}
"""What is checked after a tool's measured saves (outside its peak RSS)."""


def measure_one(
    tool: str, size_mib: int, tensors: int, saves: int, folder: Path, device: str = "cuda"
) -> dict[str, Any]:
    """One tool in this process: its figures as a dict."""
    state = make_state(size_mib, tensors, device)
    nbytes = state_bytes(state)
    with PeakRSS() as rss:
        runs = MEASURE[tool](state, saves, folder)
    if tool in CHECK:
        CHECK[tool](state, folder)
    blocked = [b for b, _ in runs]
    durable = [d for _, d in runs]
    warm_blocked = statistics.median(blocked[1:]) if len(blocked) > 1 else blocked[0]
    warm_durable = statistics.median(durable[1:]) if len(durable) > 1 else durable[0]
    return {
        "tool": tool,
        "state_bytes": nbytes,
        "first_blocked_s": round(blocked[0], 4),
        "warm_blocked_s": round(warm_blocked, 4),
        "warm_durable_s": round(warm_durable, 4),
        "warm_d2h_gib_s": round(nbytes / GiB / warm_blocked, 2),
        "peak_rss_increase_mib": None if rss.increase is None else round(rss.increase / MiB, 1),
    }


HEADER = ("tool", "first blocked s", "warm blocked s", "warm durable s", "D2H GiB/s", "peak host RSS +MiB")
WIDTHS = (10, *map(len, HEADER[1:]))


def _line(cells: tuple[str, ...]) -> str:
    return "  ".join(cell.ljust(width) for cell, width in zip(cells, WIDTHS, strict=True)).rstrip()


def heading(device: str, nbytes: int) -> str:
    """The title and the column names (the rows follow, one per tool, as measured)."""
    return f"D2H staging on {device}: {nbytes / GiB:.2f} GiB of tensors, local disk\n{_line(HEADER)}"


def row(f: dict[str, Any]) -> str:
    """One tool's figures (or why it has none) under :func:`heading`."""
    if "error" in f:
        return _line((f["tool"], f"failed: {f['error']}", "", "", "", ""))
    rss = "-" if f["peak_rss_increase_mib"] is None else f"{f['peak_rss_increase_mib']:.0f}"
    durable = "-" if f["tool"] == "floor" else f"{f['warm_durable_s']:.3f}"
    return _line((f["tool"], f"{f['first_blocked_s']:.3f}", f"{f['warm_blocked_s']:.3f}", durable,
                  f"{f['warm_d2h_gib_s']:.1f}", rss))  # fmt: skip


def table(device: str, figures: list[dict[str, Any]]) -> str:
    """The figures as one plain table (text, for a terminal or a log)."""
    nbytes = next((f["state_bytes"] for f in figures if "state_bytes" in f), 0)
    return "\n".join([heading(device, nbytes), *map(row, figures)])


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _tools(text: str) -> tuple[str, ...]:
    chosen = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in chosen if t not in TOOLS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"choose among {', '.join(TOOLS)} (comma-separated), got {text!r}")
    return chosen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=_at_least(1), default=2048, help="state size in MiB (default 2048)")
    parser.add_argument("--tensors", type=_at_least(1), default=16, help="how many tensors (default 16)")
    parser.add_argument(
        "--saves", type=_at_least(1), default=4, help="saves per tool: the first, then warm ones (default 4)"
    )
    parser.add_argument("--tools", type=_tools, default=TOOLS, help=f"which tools (default {','.join(TOOLS)})")
    parser.add_argument(
        "--budget-s", type=float, default=BUDGET_S, help=f"seconds for all tools together (default {BUDGET_S:.0f})"
    )
    parser.add_argument("--dir", help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--one", choices=TOOLS, help=argparse.SUPPRESS)  # a tool's own process
    parser.add_argument(  # the benchmark's own smoke test on a machine without a GPU
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: test this benchmark itself (no figures)"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        message = f"no CUDA device (torch {torch.__version__}, {built}): the GPU benchmark measures nothing"
        print(json.dumps({"skipped": message}) if args.json else message)
        return
    folder = Path(args.dir or tempfile.mkdtemp(prefix="aiosnap-bench-gpu-"))
    if args.one is not None:
        print(json.dumps(measure_one(args.one, args.size_mib, args.tensors, args.saves, folder, args.device)))
        return
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "the CPU (a smoke test: no figures)"
    if not args.json:
        print(heading(device, planned_bytes(args.size_mib, args.tensors)), flush=True)
    figures = []
    deadline = time.monotonic() + args.budget_s
    try:
        for left, tool in zip(range(len(args.tools), 0, -1), args.tools, strict=True):
            share = max(0.0, deadline - time.monotonic()) / left  # a quick tool leaves more for the next
            figures.append(_in_own_process(tool, args, folder / tool, share))
            if not args.json:
                print(row(figures[-1]), flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        print(json.dumps({"device": device, "tools": figures}, indent=2))
    failed = [f["tool"] for f in figures if "error" in f]
    if failed:
        print(f"aiosnap bench gpu: {', '.join(failed)} failed (see the table)", file=sys.stderr)
        raise SystemExit(1)


def _in_own_process(tool: str, args: argparse.Namespace, folder: Path, timeout_s: float) -> dict[str, Any]:
    """``tool`` measured in a new process, given ``timeout_s`` seconds; its figures, or why
    there are none (``error``)."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "aiosnap.bench", "gpu", "--one", tool, "--size-mib", str(args.size_mib),
               "--tensors", str(args.tensors), "--saves", str(args.saves), "--dir", str(folder),
               "--device", args.device]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(timeout_s, 1.0), check=False)
    except subprocess.TimeoutExpired:
        return {"tool": tool, "error": f"did not finish within its {timeout_s:.0f} s of the --budget-s"}
    last = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else []
    if not last:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"tool": tool, "error": why[:200]}
    try:
        figures: dict[str, Any] = json.loads(last[0])
    except ValueError:
        return {"tool": tool, "error": f"printed no figures: {last[0][:160]!r}"}
    return figures


if __name__ == "__main__":
    main()
