"""``make demo`` (examples/train_loop.py) works on a fresh machine, and again after that:
the second run resumes where the first one stopped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).parent.parent / "examples" / "train_loop.py"


def _demo(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEMO), "--steps", "40", "--every", "20", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _losses(stdout: str) -> dict[int, str]:
    """``step -> loss`` as the demo prints them at each save."""
    found = {}
    for line in stdout.splitlines():
        words = line.split()
        if len(words) > 3 and words[0] == "step" and words[2] == "loss":
            found[int(words[1])] = words[3]
    return found


def test_the_demo_runs_twice_in_one_folder_and_resumes(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    first = _demo(tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "a fresh start; steps 1-40" in first.stdout
    assert "restored step 40" in first.stdout and "model equal=True, optimizer equal=True" in first.stdout
    again = _demo(tmp_path)  # its own checkpoints from the first run: it goes on from them
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from step 40; steps 41-80" in again.stdout
    assert "restored step 80" in again.stdout and "model equal=True, optimizer equal=True" in again.stdout
    assert "keep_last=3): [40, 60, 80]" in again.stdout
    straight = subprocess.run(  # one run of 80 steps: the same losses as 40 steps, a restart, 40 more
        [sys.executable, str(DEMO), "--steps", "80", "--every", "20"],
        cwd=tmp_path / "elsewhere", capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-2000:]
    resumed = _losses(again.stdout)
    assert sorted(resumed) == [60, 80]
    assert {s: loss for s, loss in _losses(straight.stdout).items() if s > 40} == resumed
    config = tmp_path / "mine.yaml"
    config.write_text("storage:\n  url: ./mine\n")  # relative to the YAML file's folder
    elsewhere = tmp_path / "named"
    elsewhere.mkdir()
    named = _demo(elsewhere, "--config", str(config))
    assert named.returncode == 0 and "a fresh start" in named.stdout, named.stderr[-2000:]
    assert (tmp_path / "mine" / f"{40:012d}" / "manifest.json").is_file() and not list(elsewhere.iterdir())
