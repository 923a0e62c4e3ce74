"""One rank of a multi-rank safetensors test (launched by ``dist_launch.run_ranks(...,
child=...)``; see :mod:`dist_child` for the protocol): DTensor imports from a Hugging Face
folder, and a multi-rank save exported by every rank at once."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dist_child
from dist_child import config, dtensors, expected_of


def _counting(inner: Any) -> Any:
    from tests.conftest import FaultyStorage

    return FaultyStorage(inner)


def import_and_export(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """1. Rank 0 writes a safetensors folder of known tensors; every rank loads it into
    DTensors (Shard(0), Shard(1), Replicate; one of them bfloat16, converted) in place,
    reading about its own shards' bytes. 2. The ranks save DTensors as one aiosnap step and
    export it together: each rank uploads its own stretch of the consolidated shards."""
    import aiosnap
    from aiosnap.interop.safetensors.api import export
    from aiosnap.interop.safetensors.reader import SafetensorsFolder
    from aiosnap.storage.local import LocalStorage
    from safetensors.torch import load_file, save_file

    layouts = params["layouts"]
    expected = expected_of(layouts)
    folder = Path(work) / "hf"
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        save_file({f"w.{name}": t for name, t in expected.items()}, str(folder / "model.safetensors"))
    dist.barrier()

    targets = dtensors(layouts, zero=True)
    half = dtensors({"conv": [*layouts[params["convert"]][:3], "bfloat16"]}, zero=True)["conv"]
    before = {name: t.to_local().data_ptr() for name, t in targets.items()}
    counting = _counting(LocalStorage(folder))
    state = {"model": {f"w.{name}": t for name, t in targets.items()}}
    converted = {"model": {f"w.{params['convert']}": half}}
    with aiosnap.SyncCheckpointer(config(str(Path(work) / "unused")), storage=SafetensorsFolder(counting)) as ckpt:
        ckpt.load(state)
        ckpt.load(converted)
    result: dict[str, Any] = {
        "equal": {n: bool(torch.equal(t.full_tensor(), expected[n])) for n, t in targets.items()},
        "in_place": all(targets[n].to_local().data_ptr() == p for n, p in before.items()),
        "converted": bool(torch.equal(half.full_tensor(), expected[params["convert"]].to(torch.bfloat16))),
        "read_bytes": counting.read_bytes,
        "local_bytes": sum(t.to_local().numel() * t.to_local().element_size() for t in targets.values()),
    }

    root = str(Path(work) / "root")
    with aiosnap.SyncCheckpointer(config(root)) as ckpt:
        ckpt.save({"model": dtensors(layouts)}, step=1).wait(timeout=40)
    out = str(Path(work) / "exported")
    report = export(root, out, max_shard_size=params["max_shard_size"])
    result["export_read"] = report.bytes_read
    dist.barrier()
    if rank == 0:
        index = json.loads((Path(out) / "model.safetensors.index.json").read_text())
        found: dict[str, torch.Tensor] = {}
        for file in set(index["weight_map"].values()):
            found.update(load_file(str(Path(out) / file)))
        result["exported"] = {n: bool(torch.equal(found[n], expected[n])) for n in expected}
        result["files"] = len(set(index["weight_map"].values()))
    return result


def export_failure(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """Rank 1's part uploads fail (the real local storage, wrapped to fail): every rank
    raises (rank 1 its own error, rank 0 RankFailedError), and nothing is left behind."""
    from aiosnap.interop.safetensors.api import export
    from aiosnap.storage.local import LocalStorage

    root = str(Path(work) / "root")  # import_and_export's multi-rank save
    if rank == 1:

        async def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
            raise OSError(28, "No space left on device")

        LocalStorage.upload_part = failing  # type: ignore[method-assign]
    out = Path(work) / "failed"
    real = LocalStorage.upload_part
    try:
        export(root, str(out))
    except Exception as exc:
        dist.barrier()
        return {"raised": type(exc).__name__, "left": sorted(p.name for p in out.iterdir()) if out.exists() else []}
    finally:
        LocalStorage.upload_part = real  # type: ignore[method-assign]
    return {"raised": None}


def latest_is_agreed(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """Every rank exports the latest step of ``root`` (step 1); once the uploads have begun,
    training commits step 2 there, before rank 1 opens the source for its parts. Every rank
    writes step 1's bytes (rank 0 picked the step and its save id, the others open exactly
    that), never a mix of the two steps."""
    import shutil

    from aiosnap.interop.safetensors import api
    from safetensors.torch import load_file

    root, out = params["root"], Path(work) / "latest"
    if rank == 1:
        real = api.open_source

        async def open_source(url: str, config: Any, **kwargs: Any) -> Any:
            if any(out.glob(".model-*.tmp")) and not (Path(root) / "000000000002").exists():  # uploads begun
                shutil.copytree(Path(params["next"]) / "000000000002", Path(root) / ".incoming")
                (Path(root) / ".incoming").rename(Path(root) / "000000000002")
            return await real(url, config, **kwargs)

        api.open_source = open_source  # type: ignore[assignment]
    try:
        api.export(root, str(out), max_shard_size="1MiB")
    finally:
        if rank == 1:
            api.open_source = real  # type: ignore[assignment]
    dist.barrier()
    found: dict[str, float] = {}
    if rank == 0:
        for file in sorted(out.glob("model-*.safetensors")):
            found.update({name: float(t.flatten()[0]) for name, t in load_file(str(file)).items()})
    return {"values": found, "steps_now": sorted(p.name for p in Path(root).iterdir() if p.name.isdigit())}


def together(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """The scenarios that need no rank to die, in one launch of the ranks."""
    return {
        "import_and_export": import_and_export(rank, world, work, params),
        "latest": latest_is_agreed(rank, world, work, params),
        "failure": export_failure(rank, world, work, params),
    }


def killed_rank(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 is SIGKILLed while it uploads its first part: rank 0 hears of it as a
    RankFailedError (not gloo's connection error) and still aborts every upload and removes
    its claim: nothing is left in the destination."""
    import os

    from aiosnap.interop.safetensors.api import export
    from aiosnap.storage.local import LocalStorage

    if rank == 1:

        async def dies(self: Any, *args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), 9)

        LocalStorage.upload_part = dies  # type: ignore[method-assign]
    out = Path(work) / "exported"
    try:
        export(params["root"], str(out), max_shard_size="1MiB")
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc)[:300], "left": sorted(p.name for p in out.iterdir())}
    return {"raised": None}


if __name__ == "__main__":
    dist_child.main({"together": together, "killed_rank": killed_rank})
