"""Interrupted exports never leave a half-written shard under its final name, and the index
comes last: a part that fails, an index write that fails, an exporting process killed
mid-way. What is left is either nothing or hidden temporary files (``.<name>.<hex>.tmp``,
which no reader takes for a shard)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from aiosnap import SyncCheckpointer
from aiosnap.catalog.steps import manifest_of
from aiosnap.interop.safetensors.export import ExportOptions, export_manifest
from aiosnap.interop.safetensors.layout import INDEX_FILE
from aiosnap.storage.local import LocalStorage
from tests.conftest import FaultyStorage

REPO = Path(__file__).resolve().parent.parent


def _save(root: Path) -> None:
    generator = torch.Generator().manual_seed(2)
    state = {"model": {f"layer{i}.weight": torch.randn(256, 1024, generator=generator) for i in range(6)}}  # 6 MB
    with SyncCheckpointer({"storage": {"url": str(root)}, "ram_budget": "8MiB"}) as ckpt:
        ckpt.save(state, step=1).wait()


def _export(root: Path, dest: FaultyStorage) -> None:
    async def run() -> None:
        source = LocalStorage(root)
        manifest = await manifest_of(source, None)
        options = ExportOptions(max_shard_size=2_200_000, concurrency=2, ram_budget=16 * 1024**2)
        await export_manifest(source, manifest, dest, options)

    asyncio.run(run())


@pytest.mark.parametrize(
    "failing", ["model-00002-of-00003.safetensors#part1", "model-00003-of-00003.safetensors#complete", INDEX_FILE]
)
def test_a_failure_anywhere_leaves_no_shard_and_no_index(tmp_path: Path, failing: str) -> None:
    _save(tmp_path / "ckpt")
    out = tmp_path / "hf"
    dest = FaultyStorage(LocalStorage(out), fail_when=lambda what: what == failing, error=OSError(28, "No space left"))
    with pytest.raises(OSError, match="No space left") as caught:
        _export(tmp_path / "ckpt", dest)
    assert type(caught.value) is OSError  # the original type
    assert sorted(p.name for p in out.iterdir()) == []  # completed shards removed, uploads aborted


def test_a_killed_export_leaves_only_hidden_temporary_files(tmp_path: Path) -> None:
    """SIGKILL while parts are being written: no file under a shard's final name is ever
    half written (each becomes visible by a rename once whole), and no index."""
    _save(tmp_path / "ckpt")
    out = tmp_path / "hf"
    child = textwrap.dedent(f"""
        import asyncio, sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.conftest import FaultyStorage
        from tests.test_safetensors_faults import _export
        from aiosnap.storage.local import LocalStorage
        slow = FaultyStorage(LocalStorage({str(out)!r}), delay=0.3)
        _export(__import__("pathlib").Path({str(tmp_path / "ckpt")!r}), slow)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(out.glob(".model-*.tmp")):
            time.sleep(0.05)
        time.sleep(0.5)  # some parts written, some shards perhaps complete
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    left = sorted(p.name for p in out.iterdir())
    assert left, "the export never started"
    assert INDEX_FILE not in left
    for name in left:
        if name.startswith("."):
            assert name.endswith(".tmp")
            continue
        # a shard under its final name is whole: the safetensors library reads all of it
        from safetensors.torch import load_file

        assert load_file(out / name)
