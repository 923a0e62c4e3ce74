"""``make demo`` (examples/train_loop.py) works on a fresh machine, and again after that."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).parent.parent / "examples" / "train_loop.py"


def _demo(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEMO), "--steps", "100", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_the_demo_runs_twice_in_one_folder(tmp_path: Path) -> None:
    first = _demo(tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "model equal=True, optimizer equal=True" in first.stdout
    again = _demo(tmp_path)  # its own checkpoints from the first run: a new run starts afresh
    assert again.returncode == 0, again.stderr[-2000:]
    assert "of an earlier demo run: removing them" in again.stdout
    assert "model equal=True, optimizer equal=True" in again.stdout
    config = tmp_path / "mine.yaml"
    config.write_text(f"storage:\n  url: {tmp_path / 'checkpoints'}\n")
    refused = _demo(tmp_path, "--config", str(config))  # a root named by the user: never purged
    assert refused.returncode == 1 and "already holds steps" in refused.stdout
