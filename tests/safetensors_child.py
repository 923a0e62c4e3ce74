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
    import aiosnap
    from aiosnap.interop.safetensors.api import export
    from aiosnap.storage.local import LocalStorage

    root = str(Path(work) / "root")
    with aiosnap.SyncCheckpointer(config(root)) as ckpt:
        ckpt.save({"model": dtensors(params["layouts"])}, step=1).wait(timeout=40)
    if rank == 1:

        async def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
            raise OSError(28, "No space left on device")

        LocalStorage.upload_part = failing  # type: ignore[method-assign]
    out = Path(work) / "exported"
    try:
        export(root, str(out))
    except Exception as exc:
        dist.barrier()
        return {"raised": type(exc).__name__, "left": sorted(p.name for p in out.iterdir()) if out.exists() else []}
    return {"raised": None}


if __name__ == "__main__":
    dist_child.main({"import_and_export": import_and_export, "export_failure": export_failure})
