"""Interrupted exports never leave a model that is not the export's: no half-written shard
under its final name, the index last, and a folder of shards without an index is no model.
A part, a shard's completion or the index that fails, a cancel while a shard completes,
an overwrite that fails, two exports at once, an exporting process killed mid-way."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import CheckpointNotFoundError, SyncCheckpointer
from aiosnap.catalog.steps import manifest_of
from aiosnap.interop.safetensors.api import export, open_safetensors
from aiosnap.interop.safetensors.destination import CLAIM_FILE
from aiosnap.interop.safetensors.export import ExportOptions, export_manifest
from aiosnap.interop.safetensors.layout import INDEX_FILE
from aiosnap.storage.base import Storage
from aiosnap.storage.local import LocalStorage
from tests.conftest import FaultyStorage

REPO = Path(__file__).resolve().parent.parent


def _save(root: Path, seed: int = 2) -> None:
    generator = torch.Generator().manual_seed(seed)
    state = {"model": {f"layer{i}.weight": torch.randn(256, 1024, generator=generator) for i in range(6)}}  # 6 MB
    with SyncCheckpointer({"storage": {"url": str(root)}, "ram_budget": "8MiB"}) as ckpt:
        ckpt.save(state, step=1).wait()


async def _export_async(root: Path, dest: Storage, *, overwrite: bool = False) -> None:
    source = LocalStorage(root)
    manifest = await manifest_of(source, None)
    options = ExportOptions(max_shard_size=2_200_000, concurrency=2, ram_budget=16 * 1024**2, overwrite=overwrite)
    await export_manifest(source, manifest, dest, options)


def _export(root: Path, dest: Storage, *, overwrite: bool = False) -> None:
    """Export the 6 MB state at ``root`` as three shards into ``dest``."""
    asyncio.run(_export_async(root, dest, overwrite=overwrite))


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


def _values(folder: Path) -> dict[str, float]:
    with SyncCheckpointer({"ram_budget": "8MiB"}, storage=open_safetensors(str(folder))) as ckpt:
        return {name: float(t.flatten()[0]) for name, t in ckpt.load()["model"].items()}


def test_an_overwrite_that_fails_leaves_no_model_rather_than_a_mix(tmp_path: Path) -> None:
    """The old export is deleted (its index first) before a byte of the new one is
    written: a new export that fails part way leaves no model, never old shards that load."""
    _save(tmp_path / "ckpt")
    _save(tmp_path / "older", seed=5)
    out = tmp_path / "hf"
    export(str(tmp_path / "older"), str(out), max_shard_size=2_200_000)
    old = sorted(p.name for p in out.iterdir())
    assert len(old) == 4  # three shards and the index
    dest = FaultyStorage(
        LocalStorage(out),
        fail_when=lambda w: w == "model-00002-of-00003.safetensors#complete",
        error=OSError(28, "full"),
    )
    with pytest.raises(OSError, match="full"):
        _export(tmp_path / "ckpt", dest, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == []
    with pytest.raises(CheckpointNotFoundError):
        _values(out)


def test_a_cancel_while_a_shard_completes_removes_that_shard(tmp_path: Path) -> None:
    """A cancel (Ctrl-C) that arrives while a shard's rename runs: the rename finishes, the
    cancel comes after, and the abort still removes the shard (its completion had begun)."""
    _save(tmp_path / "ckpt")
    out = tmp_path / "hf"

    class SlowToAnswer(FaultyStorage):
        async def complete_upload(self, name: str, token: str, parts: list[Any]) -> None:
            await super().complete_upload(name, token, parts)
            if name == "model-00002-of-00003.safetensors":
                landed.set()
                await asyncio.Event().wait()  # the answer never comes: cancelled here

    landed = asyncio.Event()

    async def run() -> None:
        task = asyncio.ensure_future(_export_async(tmp_path / "ckpt", SlowToAnswer(LocalStorage(out))))
        await landed.wait()
        assert (out / "model-00002-of-00003.safetensors").exists()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert sorted(p.name for p in out.iterdir()) == []


def test_two_exports_to_one_folder_never_mix(tmp_path: Path) -> None:
    """A second export to a folder another is writing is refused by the first one's claim
    (both once succeeded, completing each other's shard names), and the first finishes."""
    _save(tmp_path / "ckpt")
    _save(tmp_path / "other", seed=5)
    out = tmp_path / "hf"

    class Held(FaultyStorage):
        async def upload_part(self, *args: Any) -> Any:
            await gate.wait()
            return await super().upload_part(*args)

    gate = asyncio.Event()

    async def run() -> None:
        async with asyncio.timeout(30):
            await both()

    async def both() -> None:
        writing = asyncio.ensure_future(_export_async(tmp_path / "ckpt", Held(LocalStorage(out))))
        while not (out / CLAIM_FILE).exists():  # noqa: ASYNC110 - a file another task makes
            await asyncio.sleep(0.01)
        with pytest.raises(FileExistsError, match="another export is writing"):
            await _export_async(tmp_path / "other", FaultyStorage(LocalStorage(out)), overwrite=True)
        gate.set()
        await writing

    asyncio.run(run())
    assert CLAIM_FILE not in {p.name for p in out.iterdir()}
    with SyncCheckpointer({"storage": {"url": str(tmp_path / "ckpt")}, "ram_budget": "8MiB"}) as ckpt:
        expected = {name: float(t.flatten()[0]) for name, t in ckpt.load()["model"].items()}
    assert _values(out) == expected


def test_a_killed_export_leaves_no_model_and_a_claim_to_remove(tmp_path: Path) -> None:
    """SIGKILL right after the first of three shards is renamed into place: a whole shard
    under its final name, no index. No reader takes the folder for a model, the next export
    is refused while the dead one's claim is there, and once it is removed an export
    replaces everything (the dead export's temporary files too)."""
    _save(tmp_path / "ckpt")
    out = tmp_path / "hf"
    child = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        from pathlib import Path
        from aiosnap.storage.local import LocalStorage
        from tests.test_safetensors_faults import _export
        from tests.conftest import FaultyStorage

        class DiesAfterOneShard(FaultyStorage):
            async def complete_upload(self, name, token, parts):
                await super().complete_upload(name, token, parts)
                os.kill(os.getpid(), 9)

        _export(Path({str(tmp_path / "ckpt")!r}), DiesAfterOneShard(LocalStorage({str(out)!r})))
    """)
    run = subprocess.run([sys.executable, "-c", child], timeout=60, capture_output=True)
    assert run.returncode == -signal.SIGKILL, run.stderr.decode()[-2000:]
    left = sorted(p.name for p in out.iterdir())
    assert "model-00001-of-00003.safetensors" in left and INDEX_FILE not in left and CLAIM_FILE in left
    assert any(name.endswith(".tmp") for name in left)  # the other shards' uploads
    with pytest.raises(CheckpointNotFoundError, match="no model.safetensors.index.json"):
        _values(out)
    with pytest.raises(FileExistsError, match=f"delete {CLAIM_FILE}"):
        export(str(tmp_path / "ckpt"), str(out), overwrite=True)
    (out / CLAIM_FILE).unlink()
    export(str(tmp_path / "ckpt"), str(out), max_shard_size=2_200_000, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [*(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)),
                                                     INDEX_FILE]  # fmt: skip
    assert len(_values(out)) == 6


def test_a_folder_of_shards_without_its_index_is_no_model(tmp_path: Path) -> None:
    """Without an index the reader takes model.safetensors or one lone file, never several
    shards, nor one shard of several (Hugging Face's loaders refuse those too)."""
    import torch
    from safetensors.torch import save_file

    for case, files in {"two": ["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"],
                        "one of three": ["model-00002-of-00003.safetensors"],
                        "unrelated pair": ["a.safetensors", "b.safetensors"]}.items():  # fmt: skip
        folder = tmp_path / case
        folder.mkdir()
        for number, file in enumerate(files):
            save_file({f"w{number}": torch.ones(2)}, str(folder / file))
        with pytest.raises(CheckpointNotFoundError, match="no model.safetensors.index.json"):
            _values(folder)
    lone = tmp_path / "lone"
    lone.mkdir()
    save_file({"w": torch.ones(2)}, str(lone / "model-00001-of-00001.safetensors"))
    assert _values(lone) == {"w": 1.0}
