"""The states ``aiosnap bench distributed`` saves, one per parallel layout (a rank's share).

- ``fsdp``: ``--size-mb`` of float32 in row-sharded DTensors over a 1-D mesh of every rank,
  plus a small replicated part (what the benchmark measured first).
- ``tp_fsdp``: a stack of square linear layers, tensor parallel over pairs of ranks
  (column-wise then row-wise) and FSDP2 over the rest (``(world/2, 2)`` mesh): parameters
  ``(_StridedShard(0), Shard(0))`` and ``(Shard(0), Shard(1))``, as torchtitan's.
  Built on the meta device, so each rank allocates only its shards.
- ``pipeline``: the same stack cut into as many stages as ranks, plain tensors (each rank
  its own layers: distinct keys), and an embedding the first and last stage both hold (tied).

Loading reshards: a checkpoint saved by N ranks loads into the layout of another job size
(``tp_fsdp`` into FSDP2 over a 1-D mesh, ``pipeline`` into fewer, larger stages). Caller's
thread of one rank, under torch.distributed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LAYOUTS", "layout_state"]

MiB = 1024 * 1024
COLUMNS = 1024
TENSORS = 8
LAYOUTS = ("fsdp", "tp_fsdp", "pipeline")


def _fsdp(size_mb: int, world: int, zero: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rows = max(world, size_mb * MiB // 4 // COLUMNS // TENSORS)
    generator = torch.Generator().manual_seed(dist.get_rank())
    model: dict[str, Any] = {}
    for index in range(TENSORS):
        local_rows = rows // world + (1 if dist.get_rank() < rows % world else 0)
        local = torch.zeros(local_rows, COLUMNS) if zero else torch.randn(local_rows, COLUMNS, generator=generator)
        model[f"layer{index}.weight"] = DTensor.from_local(
            local, mesh, [Shard(0)], shape=torch.Size([rows, COLUMNS]), stride=(COLUMNS, 1)
        )
    model["norm.weight"] = torch.zeros(64, COLUMNS) if zero else torch.ones(64, COLUMNS)  # replicated
    return {"model": model, "step": 0}


def _layers(size_mb: int) -> tuple[int, int]:
    """(layers, width) of a stack of square float32 layers of about ``size_mb`` in all."""
    width = 512
    return max(2, size_mb * MiB // 4 // width // width), width


def _filled(model: torch.nn.Module, zero: bool) -> None:
    generator = torch.Generator().manual_seed(dist.get_rank())
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.zero_() if zero else local.normal_(generator=generator)


def _tp_fsdp(size_mb: int, world: int, zero: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    layers, width = _layers(size_mb)
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    if world >= 4:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        plan: dict[str, Any] = {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(layers)}
        parallelize_module(model, mesh["tp"], plan)
        dp = mesh["dp"]
    else:  # the job a 4-rank checkpoint reshards into: FSDP2 alone
        dp = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    model.to_empty(device="cpu")
    _filled(model, zero)
    return {"model": get_model_state_dict(model), "step": 0}


def _pipeline(size_mb: int, world: int, zero: bool) -> dict[str, Any]:
    layers, width = _layers(size_mb)
    rank = dist.get_rank()
    per = -(-layers // world)
    generator = torch.Generator().manual_seed(rank)
    model: dict[str, Any] = {}
    for index in range(rank * per, min(layers, (rank + 1) * per)):
        model[f"layers.{index}.weight"] = (
            torch.zeros(width, width) if zero else torch.randn(width, width, generator=generator)
        )
    if rank in (0, world - 1):  # the embedding, tied to the last stage's output head
        model["embed.weight"] = torch.zeros(256, width) if zero else torch.ones(256, width)
    return {"model": model, "step": 0}


def layout_state(layout: str, size_mb: int, world: int, zero: bool = False) -> dict[str, Any]:
    """This rank's state of ``layout`` in a job of ``world`` ranks (zeros: a load's target)."""
    build = {"fsdp": _fsdp, "tp_fsdp": _tp_fsdp, "pipeline": _pipeline}[layout]
    return build(size_mb, world, zero)
