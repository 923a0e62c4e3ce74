"""Incremental saves: ``aiosnap bench incremental`` prints JSON figures of ``upload.dedup``.

Two states, saved ``--saves`` times each with training steps in between:

- ``fine_tune``: a LoRA-style fine-tune, a frozen base of ``--base-mb`` (``requires_grad=False``)
  with low-rank adapters, Adam over the adapters only (what changes: the adapters and their
  moments);
- ``full``: full training of ``--full-mb`` (model + Adam moments): every byte changes.

Each is saved to local disk and to the S3 test server (moto) capped at ``--cap-mb-s``
(default 100 MB/s, through :class:`~aiosnap.testing.faultproxy.FaultProxy`), with dedup off
and on and compression off and on, and to local disk with DCP ``async_save`` (its own
``FileSystemWriter``) in the same run. Per configuration: bytes written per save (the step's
own bytes), durable seconds and ``save()`` blocked seconds (the median of the saves after
the first), and the issue's ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .. import Config, SyncCheckpointer
from .results import Figure, add_results_option, compare, record
from .s3 import _create_bucket, _endpoint

MiB = 1024 * 1024
WIDTH = 1024
RANK = 8


class _Adapted(torch.nn.Module):
    def __init__(self, width: int, frozen: bool) -> None:
        super().__init__()
        self.base = torch.nn.Linear(width, width)
        if frozen:
            self.base.requires_grad_(False)
        self.lora_a = torch.nn.Parameter(torch.randn(RANK, width) * 0.01)
        self.lora_b = torch.nn.Parameter(torch.zeros(width, RANK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + x @ self.lora_a.T @ self.lora_b.T
        return out


def make_state(megabytes: int, *, fine_tune: bool, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The model and its Adam state: a frozen base of ``megabytes`` (``fine_tune``), or a
    fully trained model whose weights and moments total about ``megabytes`` (of ``dtype``)."""
    per_layer = (WIDTH * WIDTH + WIDTH) * dtype.itemsize * (1 if fine_tune else 3)
    layers = max(1, round(megabytes * 1e6 / per_layer))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_Adapted(WIDTH, fine_tune) for _ in range(layers))).to(dtype)
    optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    train_step(model, optim)
    return {"model": model, "optim": optim}


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad()
    dtype = next(model.parameters()).dtype
    model(torch.randn(4, WIDTH, dtype=dtype)).float().square().mean().backward()
    optim.step()


def _state_bytes(state: dict[str, Any]) -> int:
    tensors = list(state["model"].state_dict().values())
    for per_param in state["optim"].state_dict()["state"].values():
        tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return sum(t.nbytes for t in tensors)


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3) if values else 0.0


def _aiosnap(config: Config, state: dict[str, Any], saves: int) -> dict[str, Any]:
    """``saves`` saves with a training step before each; figures of the saves after the first."""
    written, blocked, durable = [], [], []
    with SyncCheckpointer(config) as ckpt:
        for step in range(1, saves + 1):
            train_step(state["model"], state["optim"])
            started = time.perf_counter()
            handle = ckpt.save(state, step=step)
            blocked.append(time.perf_counter() - started)
            durable.append(handle.wait().durable_s)
            written.append(ckpt.manifest(step).own_bytes)
    return {
        "first_save_bytes": written[0],
        "bytes_per_save": int(statistics.median(written[1:])) if saves > 1 else written[0],
        "blocked_s": _median(blocked[1:] or blocked),
        "durable_s": _median(durable[1:] or durable),
    }


def _dcp(folder: Path, state: dict[str, Any], saves: int) -> dict[str, Any]:
    """DCP ``async_save`` (thread) of the same state to local disk, one folder per save."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, async_save

    warnings.simplefilter("ignore")
    blocked, durable = [], []
    for step in range(1, saves + 1):
        train_step(state["model"], state["optim"])
        plain = {"model": state["model"].state_dict(), "optim": state["optim"].state_dict()}
        started = time.perf_counter()
        future: Any = async_save(
            plain, storage_writer=FileSystemWriter(str(folder / str(step))),
            async_checkpointer_type=AsyncCheckpointerType.THREAD, no_dist=True,
        )  # fmt: skip
        blocked.append(time.perf_counter() - started)
        getattr(future, "upload_completion", future).result()
        durable.append(time.perf_counter() - started)
    return {"blocked_s": _median(blocked[1:] or blocked), "durable_s": _median(durable[1:] or durable)}


@contextlib.contextmanager
def _targets(cap_mb_s: float, s3: bool) -> Iterator[dict[str, Callable[[bool, str], Config]]]:
    """Config makers (dedup on or off, compression) for each target, each call a fresh root."""
    with tempfile.TemporaryDirectory(prefix="aiosnap-bench-incremental-") as scratch:
        found: dict[str, Callable[[bool, str], Config]] = {}

        def local(dedup: bool, compression: str) -> Config:
            root = Path(scratch) / uuid.uuid4().hex
            upload = {"dedup": dedup, "compression": compression}
            return Config(storage={"url": str(root)}, upload=upload, retention={"keep_last": None})

        found["local"] = local
        with contextlib.ExitStack() as stack:
            if s3:
                url = stack.enter_context(_endpoint(None, cap_mb_s))
                bucket = f"aiosnap-bench-{uuid.uuid4().hex[:8]}"
                asyncio.run(_create_bucket(url, bucket))

                def capped(dedup: bool, compression: str) -> Config:
                    return Config(
                        storage={"url": f"s3://{bucket}/{uuid.uuid4().hex}"},
                        upload={"dedup": dedup, "compression": compression},
                        retention={"keep_last": None}, s3={"endpoint_url": url, "addressing_style": "path"},
                    )  # fmt: skip

                found[f"s3_capped_{cap_mb_s:g}mb_s"] = capped
            found["scratch"] = lambda *_: Config(storage={"url": scratch})  # where DCP writes
            yield found


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="aiosnap bench incremental", description=__doc__)
    parser.add_argument("--base-mb", type=int, default=400, help="frozen base of the fine-tune (default 400)")
    parser.add_argument("--full-mb", type=int, default=400, help="fully trained state (default 400)")
    parser.add_argument("--saves", type=int, default=5, help="saves per configuration (default 5)")
    parser.add_argument("--cap-mb-s", type=float, default=100.0, help="S3 bandwidth cap (default 100 MB/s)")
    parser.add_argument("--no-s3", action="store_true", help="local disk only")
    add_results_option(parser)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"saves": args.saves}
    workloads = {"fine_tune": (args.base_mb, True), "full": (args.full_mb, False)}
    with _targets(args.cap_mb_s, not args.no_s3) as targets:
        scratch = Path(targets.pop("scratch")(False, "none").storage.url)
        for name, (megabytes, fine_tune) in workloads.items():
            state = make_state(megabytes, fine_tune=fine_tune)
            figures: dict[str, Any] = {"state_bytes": _state_bytes(state)}
            for target, make in targets.items():
                figures[target] = {
                    f"dedup_{d}_zstd_{z}": _aiosnap(make(d == "on", "zstd" if z == "on" else "none"), state, args.saves)
                    for d in ("off", "on")
                    for z in ("off", "on")
                }
            figures["dcp_async_save_local"] = _dcp(scratch / f"dcp-{name}", state, args.saves)
            report[name] = figures
        state = make_state(args.full_mb, fine_tune=False, dtype=torch.bfloat16)  # bf16 weights and moments
        report["full_bf16"] = {
            "state_bytes": _state_bytes(state),
            "local": {
                f"dedup_off_zstd_{z}": _aiosnap(targets["local"](False, "zstd" if z == "on" else "none"), state, 2)
                for z in ("off", "on")
            },
        }
    report["ratios"] = _goals(report)
    record(args.results, _figures(report))
    print(json.dumps(report, indent=2))
    return report


def _figures(report: dict[str, Any]) -> list[Figure]:
    """The issue's goals as rows of ``aiosnap bench summary``."""
    tune, full, half = report["fine_tune"], report["full"], report["full_bf16"]
    on, off, zstd = "dedup_on_zstd_off", "dedup_off_zstd_off", "dedup_off_zstd_on"
    rows = [
        compare(
            "incremental", "fine-tune: bytes written per save after the first, dedup on",
            tune["local"][on]["bytes_per_save"] / MiB, "MiB", "the whole state", tune["state_bytes"] / MiB, 0.06,
        ),
        compare(
            "incremental", "fine-tune: durable, dedup on, local disk", tune["local"][on]["durable_s"], "s",
            "DCP async_save, local disk", tune["dcp_async_save_local"]["durable_s"], 0.2,
        ),
        compare(
            "incremental", "fp32 weights + Adam moments: bytes with zstd", full["local"][zstd]["bytes_per_save"] / MiB,
            "MiB", "raw bytes", full["local"][off]["bytes_per_save"] / MiB, 0.8,
        ),
        compare(
            "incremental", "bf16 weights + Adam moments: bytes with zstd", half["local"][zstd]["bytes_per_save"] / MiB,
            "MiB", "raw bytes", half["local"][off]["bytes_per_save"] / MiB, 0.8,
        ),
    ]  # fmt: skip
    for target in (t for t in full if t.startswith(("local", "s3"))):
        rows.append(compare(
            "incremental", f"full training: durable, dedup on, {target}", full[target][on]["durable_s"], "s",
            "dedup off", full[target][off]["durable_s"], 1.05,
        ))  # fmt: skip
        rows.append(compare(
            "incremental", f"full training: save() blocked, dedup on, {target}", full[target][on]["blocked_s"], "s",
            "dedup off", full[target][off]["blocked_s"], 1.05, note="goal: dedup adds no blocked time",
        ))  # fmt: skip
        if target.startswith("s3_capped_"):
            cap = float(target.removeprefix("s3_capped_").removesuffix("mb_s"))
            rows.append(compare(
                "incremental", f"full training: durable with zstd through {cap:g} MB/s",
                full[target][zstd]["durable_s"], "s", "raw bytes at the cap", full["state_bytes"] / (cap * 1e6), 0.85,
            ))  # fmt: skip
    return rows


def _goals(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, as measured (each with its goal)."""
    tune, full = report["fine_tune"], report["full"]
    on, off = "dedup_on_zstd_off", "dedup_off_zstd_off"
    goals: dict[str, Any] = {
        "fine_tune_bytes_per_save_over_state (goal <= 0.06)": _ratio(
            tune["local"][on]["bytes_per_save"], tune["state_bytes"]
        ),
        "fine_tune_durable_local_over_dcp (goal <= 0.2)": _ratio(
            tune["local"][on]["durable_s"], tune["dcp_async_save_local"]["durable_s"]
        ),
        "full_bytes_zstd_over_raw (goal <= 0.8)": _ratio(
            full["local"]["dedup_off_zstd_on"]["bytes_per_save"], full["local"][off]["bytes_per_save"]
        ),
    }
    for target in (t for t in full if t.startswith(("local", "s3"))):
        goals[f"full_{target}_durable_dedup_on_over_off (goal <= 1.05)"] = _ratio(
            full[target][on]["durable_s"], full[target][off]["durable_s"]
        )
        goals[f"full_{target}_blocked_dedup_on_minus_off_s (goal: none)"] = round(
            full[target][on]["blocked_s"] - full[target][off]["blocked_s"], 3
        )
        goals[f"full_{target}_durable_zstd_on_over_off"] = _ratio(
            full[target]["dedup_off_zstd_on"]["durable_s"], full[target][off]["durable_s"]
        )
        goals[f"fine_tune_{target}_durable_dedup_on_over_off"] = _ratio(
            tune[target][on]["durable_s"], tune[target][off]["durable_s"]
        )
    if "s3_capped" in " ".join(full):
        target = next(t for t in full if t.startswith("s3"))
        cap = float(target.removeprefix("s3_capped_").removesuffix("mb_s"))
        floor = full["state_bytes"] / (cap * 1e6)  # the raw bytes through the cap
        goals["full_s3_durable_zstd_over_raw_bandwidth_floor (goal <= 0.85)"] = _ratio(
            full[target]["dedup_off_zstd_on"]["durable_s"], floor
        )
    return goals


if __name__ == "__main__":
    main()
