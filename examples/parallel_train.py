"""TP+FSDP2 training on CPU (gloo), saved by every rank, resumed on another world size.

    torchrun --nproc-per-node 4 examples/parallel_train.py --root ckpts            # train, save
    torchrun --nproc-per-node 2 examples/parallel_train.py --root ckpts --resume   # resume on 2
    python examples/parallel_train.py --root ckpts --resume                        # or in 1 process

On 4 ranks a small transformer is tensor parallel over pairs of ranks (embedding by
vocabulary rows, column-wise then row-wise projections, the output column-wise) and fully
sharded (FSDP2) over the two pairs: a 2x2 mesh, whose parameters are DTensors such as
``(_StridedShard(0), Shard(0))``. It trains ``--steps`` steps, saving at the halfway step
(``save()`` returns once the shards are captured; training goes on) and at the end, whose
metadata keeps the losses of the whole run. ``--resume`` loads the halfway checkpoint into
whatever layout this world size gives (2 ranks: FSDP2 alone; 1 process: plain tensors),
trains the second half, and checks that its losses are those of the uninterrupted run. The
model trains in float64 on the same data in every layout (two data-parallel halves of each
batch), so the losses agree to ~1e-15 (tensor parallelism sums in another order).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import aiosnap
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, SEQ = 32, 16, 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM, dtype=torch.float64)
        self.up = nn.Linear(DIM, HIDDEN, dtype=torch.float64)
        self.down = nn.Linear(HIDDEN, DIM, dtype=torch.float64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class Model(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, dtype=torch.float64)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.norm = nn.LayerNorm(DIM, dtype=torch.float64)
        self.output = nn.Linear(DIM, VOCAB, bias=False, dtype=torch.float64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.output(self.norm(h))


def parallelize(model: Model, world: int) -> Model:
    """4 ranks: tensor parallel over pairs, FSDP2 over the pairs; 2 ranks: FSDP2; 1: as is."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if world == 1:
        return model
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan: dict[str, Any] = {
            "embed": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        }
        for index in range(len(model.blocks)):
            plan[f"blocks.{index}.up"] = ColwiseParallel()
            plan[f"blocks.{index}.down"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
        dp = mesh["dp"]
    elif world == 2:
        dp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    else:
        raise SystemExit(f"run on 1, 2 or 4 ranks, not {world}")
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def data_parallel_rank(world: int) -> int | None:
    """Which half of each batch this rank trains on (None: both, in one process)."""
    if world == 1:
        return None
    return dist.get_rank() // 2 if world == 4 else dist.get_rank()


def half_batch(step: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(100 * step + half))
    return tokens[:, :-1], tokens[:, 1:]


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int, dp: int | None) -> float:
    """One step; the loss of the whole batch (the mean of its two halves')."""
    halves = [0, 1] if dp is None else [dp]
    losses = [
        F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)) for x, y in (half_batch(step, h) for h in halves)
    ]
    loss = sum(losses) / len(losses)
    loss.backward()  # FSDP2 averages the gradients of the two data-parallel halves
    optim.step()
    optim.zero_grad()
    value = loss.detach().clone()
    if dp is not None:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def setup(root: str, world: int) -> tuple[nn.Module, torch.optim.Optimizer, int | None, dict[str, Any]]:
    """The model in this world size's layout, its optimizer, this rank's half of each batch,
    the checkpointer's config."""
    torch.manual_seed(0)
    model = parallelize(Model(), world)
    optim = torch.optim.AdamW(model.parameters(), lr=0.02, foreach=False)
    config = {"storage": {"url": root}, "retention": {"keep_last": None}, "events": {"log": False}}
    return model, optim, data_parallel_rank(world), config


def train(root: str, steps: int, world: int, rank: int) -> str:
    """Train ``steps`` steps in this world size's layout, saving at the halfway step and at
    the end (every rank of an initialised process group calls it)."""
    half = steps // 2
    model, optim, dp, config = setup(root, world)
    with aiosnap.SyncCheckpointer(config) as ckpt:  # every rank makes it: collective
        if rank == 0 and ckpt.steps():
            ckpt.purge()  # a fresh run each time this example runs
        if world > 1:
            dist.barrier()
        losses, handle = [], None
        for step in range(steps):
            if step == half:
                handle = ckpt.save({"train": aiosnap.ShardedState(model, optim), "step": step}, step=step)
            losses.append(train_step(model, optim, step, dp))  # the save runs meanwhile
        assert handle is not None
        handle.wait()
        ckpt.save({"step": steps}, step=steps, metadata={"losses": losses}).wait()
    return f"rank {rank}/{world}: trained {steps} steps, saved step {half} and {steps}"


def resume(root: str, steps: int, world: int, rank: int) -> tuple[bool, str]:
    """Load the halfway checkpoint into this world size's layout, train the second half;
    whether its losses are the uninterrupted run's."""
    half = steps // 2
    model, optim, dp, config = setup(root, world)
    with aiosnap.SyncCheckpointer(config) as ckpt:
        state = {"train": aiosnap.ShardedState(model, optim), "step": -1}
        ckpt.load(state, step=half)  # resharded into this world size's layout
        losses = [train_step(model, optim, step, dp) for step in range(state["step"], steps)]
        expected = ckpt.manifest(steps).metadata["losses"][half:]
    same = len(losses) == len(expected) and all(
        math.isclose(a, b, rel_tol=1e-12) for a, b in zip(losses, expected, strict=True)
    )
    return same, f"rank {rank}/{world}: resumed at step {half}; losses equal to an uninterrupted run: {same}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="./checkpoints-parallel", help="a folder every rank sees, or s3://...")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--resume", action="store_true", help="resume the halfway checkpoint on this world size")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    same = True
    if args.resume:
        same, said = resume(args.root, args.steps, world, rank)
    else:
        said = train(args.root, args.steps, world, rank)
    print(said)
    if world > 1:
        dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
