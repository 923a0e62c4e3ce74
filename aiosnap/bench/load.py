"""Benchmark of restores: ``aiosnap bench load`` prints JSON figures.

A model + Adam state (~``--size-mb`` MB) is saved once by each tool to a local directory;
then each restore runs in a fresh process (alternating tools, ``--runs`` rounds, page cache
warm), into a model and optimizer of the same shapes, as a training job resuming would:

- ``aiosnap``: ``SyncCheckpointer.load(state)`` (in place, every range verified);
- ``aiosnap_atomic``: the same with ``atomic=True`` (new tensors, verified, then copied);
- ``torch``: ``torch.load`` + ``load_state_dict`` on the module and the optimizer;
- ``dcp``: ``torch.distributed.checkpoint.load`` (one process) into the state dicts that
  ``get_state_dict`` gives, then ``set_state_dict``.

And a many-tensor state (``--many`` tensors of 1 KB): aiosnap ``load()`` vs ``torch.load``.
Figures per tool: seconds of the restore (median and all runs) and peak RSS increase
(Linux) during it; ratios against DCP and ``torch.load``. An aiosnap checkpointer is made
before the clock starts (a job makes one anyway, to save).
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
import warnings
from pathlib import Path
from typing import Any

import torch

from .local import PeakRSS, make_state

MiB = 1024 * 1024
TOOLS = ("aiosnap", "aiosnap_atomic", "torch", "dcp")


def _state_dicts(model: torch.nn.Module, optim: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_state_dict(model, optim)


def save_all(folder: Path, size_mb: int, many: int) -> None:
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from .. import Config, SyncCheckpointer

    torch.manual_seed(0)
    model, optim = make_state(size_mb)
    with SyncCheckpointer(Config(storage={"url": str(folder / "aiosnap")}, events={"log": False})) as ckpt:
        ckpt.save({"model": model, "optim": optim}, step=1).wait()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, folder / "torch.pt")
    model_sd, optim_sd = _state_dicts(model, optim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / "dcp"))
    (folder / "expected.json").write_text(json.dumps(_fingerprint(model, optim)))
    generator = torch.Generator().manual_seed(1)
    small = {f"t{i}": torch.randn(256, generator=generator) for i in range(many)}
    with SyncCheckpointer(Config(storage={"url": str(folder / "many")}, events={"log": False})) as ckpt:
        ckpt.save(small, step=1).wait()
    torch.save(small, folder / "many.pt")


def _fingerprint(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[float]:
    moments = [s["exp_avg"] for s in optim.state.values()]
    with torch.no_grad():
        return [float(p.double().sum()) for p in model.parameters()] + [float(m.double().sum()) for m in moments]


def restore_once(folder: Path, tool: str, size_mb: int) -> dict[str, Any]:
    """In a fresh process: restore with ``tool``, timed, and check the values."""
    from .. import Config, SyncCheckpointer

    root = folder / ("many" if tool.startswith("many_") else "aiosnap")
    ckpt = SyncCheckpointer(Config(storage={"url": str(root)}, events={"log": False})) if "aiosnap" in tool else None
    try:
        return _restore(folder, tool, size_mb, ckpt)
    finally:
        if ckpt is not None:
            ckpt.close()


def _restore(folder: Path, tool: str, size_mb: int, ckpt: Any) -> dict[str, Any]:
    """The restore itself, timed (the checkpointer, if any, exists already: a job makes it
    once, to save as well)."""
    if tool.startswith("many_"):
        with PeakRSS() as rss:
            started = time.perf_counter()
            if ckpt is not None:
                ckpt.load()
            else:
                torch.load(folder / "many.pt")
            seconds = time.perf_counter() - started
        return {"tool": tool, "seconds": seconds, "rss_mib": (rss.increase or 0) / MiB}
    torch.manual_seed(5)  # other values, same shapes
    model, optim = make_state(size_mb)
    with PeakRSS() as rss:
        started = time.perf_counter()
        if ckpt is not None:
            ckpt.load({"model": model, "optim": optim}, atomic=tool == "aiosnap_atomic")
        elif tool == "torch":
            loaded = torch.load(folder / "torch.pt")
            model.load_state_dict(loaded["model"])
            optim.load_state_dict(loaded["optim"])
            del loaded
        else:
            from torch.distributed.checkpoint.state_dict import set_state_dict
            from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

            model_sd, optim_sd = _state_dicts(model, optim)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / "dcp"))
                set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
        seconds = time.perf_counter() - started
    expected = json.loads((folder / "expected.json").read_text())
    ok = all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(_fingerprint(model, optim), expected, strict=True))
    return {"tool": tool, "seconds": seconds, "rss_mib": (rss.increase or 0) / MiB, "ok": ok}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="aiosnap bench load", description=__doc__)
    parser.add_argument("--size-mb", type=int, default=500, help="model + Adam state size (default 500)")
    parser.add_argument("--many", type=int, default=40_000, help="tensors in the many-tensor state (default 40000)")
    parser.add_argument("--runs", type=int, default=3, help="restores per tool (default 3)")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: restore once with this tool
    args = parser.parse_args(argv)
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="aiosnap-bench-load-"))
    if args.one:
        print(json.dumps(restore_once(folder, args.one, args.size_mb)))
        return {}
    try:
        save_all(folder, args.size_mb, args.many)
        results: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.runs):
            for tool in (*TOOLS, "many_aiosnap", "many_torch"):
                child = subprocess.run(
                    [sys.executable, "-m", "aiosnap.bench.load", "--one", tool, "--dir", str(folder),
                     "--size-mb", str(args.size_mb)],
                    capture_output=True, text=True, check=True, timeout=600,
                )  # fmt: skip
                results.setdefault(tool, []).append(json.loads(child.stdout.strip().splitlines()[-1]))
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    figures = {
        tool: {
            "median_s": round(statistics.median(r["seconds"] for r in runs), 3),
            "runs_s": [round(r["seconds"], 3) for r in runs],
            "peak_rss_increase_mib": round(max(r["rss_mib"] for r in runs), 1),
            **({"values_equal": all(r["ok"] for r in runs)} if "ok" in runs[0] else {}),
        }
        for tool, runs in results.items()
    }
    ours = figures["aiosnap"]["median_s"]
    report = {
        "state_mb": args.size_mb,
        "many_tensors": args.many,
        **figures,
        "ratios": {
            "aiosnap_over_dcp": round(ours / figures["dcp"]["median_s"], 2),
            "aiosnap_over_torch": round(ours / figures["torch"]["median_s"], 2),
            "many_aiosnap_over_torch_load": round(
                figures["many_aiosnap"]["median_s"] / figures["many_torch"]["median_s"], 2
            ),
        },
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
