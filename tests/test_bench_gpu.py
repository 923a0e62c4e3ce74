"""The GPU benchmark (``aiosnap bench gpu``, in ``make gpu-check``): on a machine without CUDA
it says so and exits 0; with CUDA it measures every tool and aiosnap's values round-trip."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from aiosnap.bench.gpu import TOOLS, _in_own_process, main, measure_one, table

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiosnap", "bench", "gpu", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_cuda_it_says_so_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    main([])
    assert capsys.readouterr().out.startswith("no CUDA device (torch ")
    main(["--json"])
    assert "measures nothing" in json.loads(capsys.readouterr().out)["skipped"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP, one process
def test_every_tool_runs_its_whole_path_on_the_cpu(tmp_path: Path) -> None:
    """The benchmark's own smoke test where there is no GPU: the same code, CPU tensors."""
    for tool in TOOLS:
        figures = measure_one(tool, 4, 3, 2, tmp_path / tool, device="cpu")
        assert figures["tool"] == tool and figures["warm_blocked_s"] > 0 and figures["state_bytes"] >= 0.99 * 4 * 2**20
    args = argparse.Namespace(size_mib=2, tensors=2, saves=1, device="cpu")
    in_own_process = _in_own_process("floor", args, tmp_path / "process")  # what main() runs per tool
    assert in_own_process["tool"] == "floor" and "error" not in in_own_process, in_own_process


def test_the_table_has_a_row_per_tool_and_shows_a_failure() -> None:
    figures = [
        {"tool": "floor", "state_bytes": 2**31, "first_blocked_s": 0.05, "warm_blocked_s": 0.04,
         "warm_durable_s": 0.04, "warm_d2h_gib_s": 50.0, "peak_rss_increase_mib": 2048.0},
        {"tool": "aiosnap", "state_bytes": 2**31, "first_blocked_s": 0.09, "warm_blocked_s": 0.05,
         "warm_durable_s": 1.2, "warm_d2h_gib_s": 40.0, "peak_rss_increase_mib": None},
        {"tool": "dcp_pinned", "error": "did not finish within 150 s"},
    ]  # fmt: skip
    lines = table("NVIDIA H200", figures).splitlines()
    assert lines[0] == "D2H staging on NVIDIA H200: 2.00 GiB of tensors, local disk"
    assert lines[1].split()[:2] == ["tool", "first"] and len(lines) == 5
    assert lines[2].split() == ["floor", "0.050", "0.040", "-", "50.0", "2048"]
    assert lines[3].split() == ["aiosnap", "0.090", "0.050", "1.200", "40.0", "-"]
    assert "dcp_pinned" in lines[4] and "failed: did not finish within 150 s" in lines[4]


@pytest.mark.gpu
@needs_cuda
def test_every_tool_is_measured_on_the_gpu() -> None:
    run = _bench("--size-mib", "64", "--tensors", "4", "--saves", "2", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert [f["tool"] for f in report["tools"]] == list(TOOLS)
    for figures in report["tools"]:
        assert "error" not in figures, figures
        assert figures["warm_blocked_s"] > 0 and figures["warm_d2h_gib_s"] > 0
        assert figures["state_bytes"] >= 64 * 2**20 * 0.99
