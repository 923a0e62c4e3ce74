"""One rank of a multi-rank DCP test: ``python dcp_child.py SCENARIO RANK WORLD PORT WORKDIR PARAMS``
(launched by :func:`dist_launch.run_ranks` with ``child=`` this file; see dist_child.py).

An FSDP2 model and its AdamW state (DTensors) are saved by 2 ranks through DCP -- with
aiosnap's writer (``dcp.save``, ``async_save`` THREAD and PROCESS) and with torch's own
``FileSystemWriter`` -- and loaded on another number of ranks, hence another sharding, with
DCP through aiosnap's reader and torch's, and through aiosnap's own load path.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_child import main

CONFIG = {"ram_budget": "4MiB", "upload": {"chunk_size": "64KiB"}, "events": {"log": False}}
"""64 KiB slabs: the 40,000-element embedding (160 KB) is written as tiles."""


def _model(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(400, 100), torch.nn.Linear(100, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)
    )
    for layer in model:
        if isinstance(layer, (torch.nn.Linear, torch.nn.Embedding)):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "train": {"step": 3, "lr": 0.01}}


def _full(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if hasattr(value, "full_tensor"):
        return value.full_tensor()
    return value.clone() if isinstance(value, torch.Tensor) else value


def save_fsdp(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    import aiosnap
    import aiosnap.dcp
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    model, optim = _model(world, 0)
    model(torch.randint(0, 400, (6, 3)).view(-1)).sum().backward()
    optim.step()
    state = _state(model, optim)
    root = Path(params["root"])
    full = _full(state)  # a collective: every rank
    if rank == 0:
        torch.save(full, root / "expected.pt")
    dcp.save(state, storage_writer=aiosnap.dcp.StorageWriter(root / "aiosnap", CONFIG))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(root / "torch"))
    writer = aiosnap.dcp.StorageWriter(root / "thread", CONFIG)
    dcp.async_save(state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.THREAD).result()
    writer = aiosnap.dcp.StorageWriter(root / "process", CONFIG)
    dcp.async_save(state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    native = {**CONFIG, "storage": {"url": str(root / "native")}, "distributed": {"commit_timeout": 60}}
    with aiosnap.SyncCheckpointer(native) as ckpt:  # aiosnap's own multi-rank format, for the converter
        ckpt.save({**state, "rank": {"seed": 100 + rank}}, step=5, rank_local=["rank"]).wait(timeout=60)
    return {"files": sorted(p.name for p in (root / "aiosnap").iterdir())}


def _same(loaded: Any, expected: Any) -> bool:
    if isinstance(expected, dict):
        return set(loaded) == set(expected) and all(_same(loaded[k], v) for k, v in expected.items())
    if isinstance(expected, torch.Tensor):
        return bool(torch.equal(_full(loaded), expected))
    return bool(loaded == expected)


def load_fsdp(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    import aiosnap.dcp
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    root = Path(params["root"])
    expected = torch.load(root / "expected.pt", weights_only=True)
    found: dict[str, bool] = {}
    readers = {
        "aiosnap reader, aiosnap writer": lambda: aiosnap.dcp.StorageReader(root / "aiosnap", CONFIG),
        "aiosnap reader, torch writer": lambda: aiosnap.dcp.StorageReader(root / "torch", CONFIG),
        "aiosnap reader, async thread": lambda: aiosnap.dcp.StorageReader(root / "thread", CONFIG),
        "aiosnap reader, async process": lambda: aiosnap.dcp.StorageReader(root / "process", CONFIG),
        "torch reader, aiosnap writer": lambda: dcp.FileSystemReader(root / "aiosnap"),
    }
    for name, reader in readers.items():
        model, optim = _model(world, 1)  # other weights, no optimizer state yet
        model(torch.randint(0, 400, (2, 3)).view(-1)).sum().backward()
        optim.step()  # the optimizer's state exists (DCP loads into it)
        state = _state(model, optim)
        dcp.load(state, storage_reader=reader())
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        found[name] = _same(_state(model, optim), expected)
    for name in ("aiosnap", "torch"):  # aiosnap's own load path, resharded into the DTensors in place
        model, optim = _model(world, 2)
        model(torch.randint(0, 400, (2, 3)).view(-1)).sum().backward()
        optim.step()
        state = _state(model, optim)
        before = {k: v.to_local().data_ptr() for k, v in state["model"].items()}
        aiosnap.dcp.load(state, root / name, config=CONFIG)
        in_place = all(v.to_local().data_ptr() == before[k] for k, v in state["model"].items())
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        found[f"aiosnap.dcp.load, {name} writer"] = _same(_state(model, optim), expected) and in_place
    return found


if __name__ == "__main__":
    warnings.filterwarnings("ignore", category=FutureWarning)  # DCP's own deprecations
    main(globals())
