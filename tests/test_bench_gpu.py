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
from aiosnap import SyncCheckpointer
from aiosnap.bench import gpu
from aiosnap.bench.gpu import BUDGET_S, TOOLS, _in_own_process, main, measure_one, table
from aiosnap.bench.local import PeakRSS

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
    in_own_process = _in_own_process("floor", args, tmp_path / "process", 60.0)  # what main() runs per tool
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


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_failing_tool_fails_the_run_and_rows_come_as_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiosnap's saves fail (its root already holds a later step, so step 1 is refused): its
    row says why, the other tool's row stands, and the exit status is 1. Each row is out
    before the next tool starts."""
    with SyncCheckpointer(str(tmp_path / "aiosnap" / "aiosnap")) as ckpt:
        ckpt.save({"w": torch.zeros(1)}, step=5).wait()
    printed: list[str] = []
    real = gpu._in_own_process

    def noting_what_is_out(tool: str, *args: object) -> dict[str, object]:
        printed.append(capsys.readouterr().out)
        return real(tool, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(gpu, "_in_own_process", noting_what_is_out)
    argv = ["--device", "cpu", "--size-mib", "1", "--tensors", "2", "--saves", "1", "--tools", "floor,aiosnap"]
    with pytest.raises(SystemExit) as failed:
        main([*argv, "--dir", str(tmp_path)])
    assert failed.value.code == 1
    rest = capsys.readouterr()
    lines = "".join([*printed, rest.out]).splitlines()
    assert lines[0].startswith("D2H staging on the CPU") and lines[1].split()[:2] == ["tool", "first"]
    assert printed[1].split()[0] == "floor"  # floor's row was out before aiosnap started
    assert lines[2].split()[0] == "floor" and "failed" not in lines[2]
    assert lines[3].startswith("aiosnap     failed: aiosnap.errors.StepOrderError: step 1 is older") and len(lines) == 4
    assert "aiosnap failed" in rest.err


def test_a_bad_option_is_a_usage_error_not_a_row_of_failures(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in (["--tensors", "0"], ["--saves", "0"], ["--size-mib", "-1"], ["--tools", "floor,nope"]):
        with pytest.raises(SystemExit) as usage:
            main(["--device", "cpu", *bad])
        assert usage.value.code == 2, bad
        assert bad[0] in capsys.readouterr().err


def test_the_tools_share_one_budget_that_fits_make_gpu_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    outer = next(line for line in makefile.splitlines() if "aiosnap.bench gpu" in line and "timeout" in line)
    assert float(outer.split()[1]) >= BUDGET_S + 20  # the benchmark ends (and prints) before make's timeout
    given: list[float] = []

    def quick(tool: str, args: object, folder: Path, timeout_s: float) -> dict[str, object]:
        given.append(timeout_s)
        return {"tool": tool, "error": "not measured here"}

    monkeypatch.setattr(gpu, "_in_own_process", quick)
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--budget-s", "90", "--dir", str(tmp_path)])
    assert len(given) == 3 and 29 < given[0] <= 30 and given[1] > 44 and given[2] > 88  # left over: passed on


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_aiosnaps_value_check_comes_after_its_measured_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check loads a full host copy of the state: inside the peak-RSS measurement it
    would count against aiosnap only. And it does check: other values are refused."""
    real = gpu.CHECK["aiosnap"]
    seen: list[int] = []

    def check(state: dict[str, torch.Tensor], folder: Path) -> None:
        seen.append(len(PeakRSS._open))
        real(state, folder)
        changed = {key: tensor + 1 for key, tensor in state.items()}
        with pytest.raises(RuntimeError, match="values differ"):
            real(changed, folder)

    monkeypatch.setitem(gpu.CHECK, "aiosnap", check)
    figures = measure_one("aiosnap", 2, 2, 2, tmp_path, device="cpu")
    assert seen == [0] and figures["peak_rss_increase_mib"] is not None
