"""The safetensors guide's Python blocks run as they are, in order, in a fresh folder, and
again in the same folder (a snippet that fails on a second run is a bug)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "safetensors.md"
_BLOCK = re.compile(r"(<!-- docs-test: skip[^\n]*-->\n)?```python\n(.*?)```", re.S)


def _blocks() -> list[str]:
    return [code for skip, code in _BLOCK.findall(PAGE.read_text()) if not skip]


def test_the_guide_runs_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    blocks = _blocks()
    assert len(blocks) >= 6
    for attempt in range(2):
        namespace: dict[str, object] = {"__name__": "__docs__"}
        for number, code in enumerate(blocks):
            try:
                exec(compile(code, f"{PAGE.name} block {number} (run {attempt + 1})", "exec"), namespace)  # noqa: S102
            except Exception as exc:
                raise AssertionError(f"block {number}, run {attempt + 1}:\n{code}") from exc
    assert os.listdir(tmp_path)
