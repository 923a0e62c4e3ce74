"""Benchmark: ``aiosnap bench local`` (or ``make bench``) prints JSON figures.

Saves a model + Adam state (~500 MB by default) to a local directory, cold then warm
(with a training step mutating every tensor in between), and measures in the same run.
"cold" is the first save of a checkpointer after ``--train-s`` seconds of training steps;
"at_start" is a first save made the moment the checkpointer exists. Staging memory becomes
resident as saves first write it (the RAM budget is a ceiling), so a first save pays for
first touching its pages, as any snapshot into fresh memory does.

- ``floor``: a plain copy of the same tensors into preallocated, already-touched buffers
  (the least any snapshot can block training), best of 3; ``warm_floor``: the same copy
  after a training step, alternating with the warm saves (``--warm-rounds``), median: what
  the warm saves are compared with, measured in their conditions;
- ``fresh_copy``: a copy of the same tensors into newly allocated buffers (``clone``: what a
  snapshot into fresh memory pays, first touch included);
- ``torch_save``: plain ``torch.save`` of the same state to the same disk (blocking);
- ``dcp_async_save``: how long DCP's ``async_save`` (thread checkpointer, one process)
  blocks on a warm call with the same tensors (``--no-dcp``: skipped);
- aiosnap with a RAM budget larger than the state, and with a small budget (128 MiB).

Figures: blocked seconds (until ``save()`` returned), seconds to durable, RSS added by a
checkpointer once made (idle) and at its peak (Linux, via /proc), the budget's high-water
mark, and ratios against the floors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

import torch

from .. import Config, SyncCheckpointer
from .results import add_results_option, compare, record

MiB = 1024 * 1024


def _proc_status(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakRSS:
    """Peak resident memory above the level at start (Linux: resets VmHWM; nests: an inner
    one hands the peak so far to the outer ones before it resets)."""

    _open: ClassVar[list[PeakRSS]] = []

    @classmethod
    def _note_peak(cls) -> None:
        peak = _proc_status("VmHWM")
        for outer in cls._open:
            if peak is not None:
                outer.peak = max(outer.peak or 0, peak)

    def __enter__(self) -> PeakRSS:
        self._note_peak()
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")
        self.base = _proc_status("VmRSS")
        self.peak: int | None = None
        self.increase: int | None = None
        self._open.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._note_peak()
        self._open.remove(self)
        if self.peak is not None and self.base is not None:
            self.increase = self.peak - self.base


def make_state(total_mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A stack of square Linear layers whose params + Adam moments total ~``total_mb``."""
    width = 2048
    per_layer = (width * width + width) * 4 * 3  # weights, exp_avg, exp_avg_sq
    layers = max(1, round(total_mb * 1e6 / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    train_step(model, optim)
    return model, optim


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad()
    model(torch.randn(4, 2048)).square().mean().backward()
    optim.step()


def state_tensors(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = list(model.state_dict().values())
    for per_param in optim.state_dict()["state"].values():
        tensors.extend(v for v in per_param.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return tensors


def touched_buffers(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A buffer per tensor, already written (no allocation or first-touch cost in a timing)."""
    buffers = [torch.empty_like(t) for t in tensors]
    for b in buffers:
        b.zero_()
    return buffers


def copy_s(buffers: list[torch.Tensor], tensors: list[torch.Tensor]) -> float:
    """Seconds to copy ``tensors`` into ``buffers`` once: the floor of any snapshot."""
    started = time.perf_counter()
    for b, t in zip(buffers, tensors, strict=True):
        b.copy_(t)
    return time.perf_counter() - started


def fresh_copy_s(tensors: list[torch.Tensor]) -> float:
    """Seconds to copy ``tensors`` into new memory (first touch included), once: the memory
    is given back between rounds, so later rounds may find pages the allocator kept."""
    started = time.perf_counter()
    copies = [t.clone() for t in tensors]
    elapsed = time.perf_counter() - started
    del copies
    return elapsed


def torch_save_s(model: torch.nn.Module, optim: torch.optim.Optimizer, path: Path) -> float:
    started = time.perf_counter()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, path)
    return time.perf_counter() - started


def dcp_async_save_blocked_s(tensors: list[torch.Tensor], folder: Path) -> float | None:
    """Seconds ``torch.distributed.checkpoint.async_save`` (its thread checkpointer, one
    process) blocks on a warm call (the second) with the same tensors; None without DCP."""
    try:
        from torch.distributed.checkpoint.state_dict_saver import async_save
    except ImportError:
        return None
    import warnings

    state = {f"t{i}": t for i, t in enumerate(tensors)}
    blocked = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for attempt in range(2):
            started = time.perf_counter()
            future: Any = async_save(state, checkpoint_id=str(folder / f"dcp-{attempt}"), no_dist=True)
            blocked = time.perf_counter() - started
            getattr(future, "upload_completion", future).result()
    return blocked


def _train_for(model: torch.nn.Module, optim: torch.optim.Optimizer, seconds: float) -> None:
    began = time.perf_counter()
    train_step(model, optim)
    while time.perf_counter() - began < seconds:
        train_step(model, optim)


def aiosnap_run(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    root: Path,
    budget: int,
    train_s: float,
    *,
    warm_rounds: int = 1,
    floor_buffers: list[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """A first save the moment a checkpointer exists, then, in a second checkpointer, a cold
    save after ``train_s`` of training and ``warm_rounds`` warm saves, each after one training
    step. With ``floor_buffers``, each warm save alternates with a copy of the state into them
    after the same training step (``warm_floor_s``: their median): the floor measured in the
    same conditions as the save, whatever the cache and the machine do meanwhile. The warm
    figures are the medians of the rounds."""
    config = Config(storage={"url": str(root)}, ram_budget=budget, retention={"keep_last": 1})
    figures: dict[str, Any] = {"ram_budget_mib": budget / MiB}
    with PeakRSS() as first_run:
        base = _proc_status("VmRSS")
        with SyncCheckpointer(config) as ckpt:
            now = _proc_status("VmRSS")
            idle = None if now is None or base is None else round((now - base) / MiB, 1)
            started = time.perf_counter()
            handle = ckpt.save({"model": model, "optim": optim}, step=1)
            figures["at_start"] = {"blocked_s": round(time.perf_counter() - started, 4)}
            handle.wait()
    figures["idle_rss_increase_mib"] = idle  # the checkpointer made, nothing saved yet
    figures["at_start"]["peak_rss_increase_mib"] = _mib(first_run.increase)
    shutil.rmtree(root, ignore_errors=True)
    rounds: list[dict[str, Any]] = []
    floors: list[float] = []
    tensors = state_tensors(model, optim)
    with PeakRSS() as whole_run, SyncCheckpointer(config) as ckpt:
        for step in range(1, 2 + warm_rounds):
            if step > 1 and floor_buffers is not None:
                _train_for(model, optim, 0.0)
                floors.append(copy_s(floor_buffers, tensors))
            # every tensor changes between saves, as in training
            _train_for(model, optim, train_s if step == 1 else 0.0)
            with PeakRSS() as rss:
                started = time.perf_counter()
                handle = ckpt.save({"model": model, "optim": optim}, step=step)
                blocked = time.perf_counter() - started
                result = handle.wait()
            rounds.append({
                "blocked_s": round(blocked, 4),
                "durable_s": round(result.durable_s, 4),
                "peak_rss_increase_mib": None if rss.increase is None else round(rss.increase / MiB, 1),
                "budget_high_water_mib": round(result.ram_high_water / MiB, 1),
                "write_mb_s": round(result.nbytes / 1e6 / result.durable_s, 1),
            })  # fmt: skip
    figures["cold"] = rounds[0]
    figures["warm"] = {key: _median([r[key] for r in rounds[1:]]) for key in rounds[1]}
    figures["warm"]["rounds_blocked_s"] = [r["blocked_s"] for r in rounds[1:]]
    if floors:
        figures["warm_floor_s"] = round(statistics.median(floors), 4)
        figures["warm_floor_rounds_s"] = [round(f, 4) for f in floors]
    # from the checkpointer's start to after the warm save: staging, threads, whatever else it takes
    figures["run_peak_rss_increase_mib"] = _mib(whole_run.increase)
    return figures


def _median(values: list[Any]) -> Any:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 4) if known else None


def _mib(nbytes: int | None) -> float | None:
    return None if nbytes is None else round(nbytes / MiB, 1)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="aiosnap bench local", description=__doc__)
    parser.add_argument("--size-mb", type=int, default=500, help="state size (default 500)")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--small-budget-mib", type=int, default=128)
    parser.add_argument("--train-s", type=float, default=2.0, help="training before the cold save (default 2)")
    parser.add_argument("--no-dcp", action="store_true", help="skip DCP async_save (the second anchor)")
    parser.add_argument(
        "--warm-rounds", type=int, default=3,
        help="warm saves, each alternating with a floor copy after the same training step; medians (default 3)",
    )  # fmt: skip
    add_results_option(parser)
    args = parser.parse_args(argv)
    if args.warm_rounds < 1:
        parser.error("--warm-rounds must be at least 1")
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="aiosnap-bench-"))
    torch.manual_seed(0)
    model, optim = make_state(args.size_mb)
    tensors = state_tensors(model, optim)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    try:
        buffers = touched_buffers(tensors)
        floor = min(copy_s(buffers, tensors) for _ in range(3))
        fresh = fresh_copy_s(tensors)
        plain = torch_save_s(model, optim, base / "torch_save.pt")
        dcp = None if args.no_dcp else dcp_async_save_blocked_s(tensors, base)
        large = aiosnap_run(model, optim, base / "large", max(2 * nbytes, 256 * MiB), args.train_s,
                            warm_rounds=args.warm_rounds, floor_buffers=buffers)  # fmt: skip
        del buffers
        small = aiosnap_run(model, optim, base / "small", args.small_budget_mib * MiB, args.train_s)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    report: dict[str, Any] = {
        "state_bytes": nbytes,
        "torch_threads": torch.get_num_threads(),
        "floor_copy_s": round(floor, 4),
        "fresh_copy_s": round(fresh, 4),
        "torch_save_s": round(plain, 4),
        "dcp_async_save_blocked_s": None if dcp is None else round(dcp, 4),
        "budget_larger_than_state": large,
        "budget_small": small,
        "ratios": {
            "warm_blocked_over_floor": round(large["warm"]["blocked_s"] / floor, 2),
            "cold_blocked_over_floor": round(large["cold"]["blocked_s"] / floor, 2),
            "at_start_blocked_over_floor": round(large["at_start"]["blocked_s"] / floor, 2),
            "at_start_blocked_over_fresh_copy": round(large["at_start"]["blocked_s"] / fresh, 2),
            "large_budget_run_peak_rss_over_state": None
            if large["run_peak_rss_increase_mib"] is None
            else round(large["run_peak_rss_increase_mib"] * MiB / nbytes, 2),
            "torch_save_over_warm_blocked": round(plain / large["warm"]["blocked_s"], 2),
            "small_budget_run_peak_rss_over_budget": None
            if small["run_peak_rss_increase_mib"] is None
            else round(small["run_peak_rss_increase_mib"] / small["ram_budget_mib"], 2),
        },
    }
    if dcp is not None:
        report["ratios"]["warm_blocked_over_dcp_async_save"] = round(large["warm"]["blocked_s"] / dcp, 2)
    warm = large["warm"]["blocked_s"]
    warm_floor = large["warm_floor_s"]
    report["ratios"]["warm_blocked_over_warm_floor"] = round(warm / warm_floor, 2)
    figures = [compare("local", f"warm save() blocked, {nbytes / 1e6:.0f} MB model+Adam, median of {args.warm_rounds}",
                       warm, "s", f"memcpy into touched buffers after the same training step, alternating with the "
                       f"saves, median of {args.warm_rounds}", warm_floor, 1.25)]  # fmt: skip
    if dcp is not None:
        figures.append(compare("local", f"warm save() blocked vs DCP, {nbytes / 1e6:.0f} MB model+Adam", warm, "s",
                               "DCP async_save (thread), warm call", dcp, 0.4))  # fmt: skip
    record(args.results, figures)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
