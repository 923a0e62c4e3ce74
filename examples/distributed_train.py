"""Multi-rank checkpoints: FSDP2 on CPU with gloo, saved by every rank, resumed.

Run with ``torchrun --nproc-per-node 2 examples/distributed_train.py [--root PATH]``.
Each rank trains a fully sharded model on its own batches, saves every ``--every`` steps
(parameters and optimizer state as DTensor shards, written once per shard; the RNG state
and the data position per rank), then a fresh model resumes from the latest checkpoint and
must reach the same losses as the uninterrupted run. Works with any number of ranks, and
loads checkpoints saved with another number (the RNG state is then skipped).
"""

from __future__ import annotations

import argparse
import os
import sys

import aiosnap
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def build(mesh: object, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: range, rank: int) -> list[float]:
    losses = []
    for step in steps:
        batch = torch.Generator().manual_seed(10_000 * step + rank)  # this rank's data
        x = torch.randn(16, 32, generator=batch)
        noise = torch.rand(16, 8)  # the global RNG: each rank's own state is checkpointed
        loss = (model(x) - noise).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(round(loss.item(), 6))
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", default="./checkpoints-distributed", help="a folder every rank sees, or s3://...")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    config = {"storage": {"url": args.root}, "retention": {"keep_last": 2}, "events": {"log": rank == 0}}
    with aiosnap.SyncCheckpointer(config) as ckpt:  # every rank makes it: collective
        if rank == 0 and ckpt.steps():
            ckpt.purge()  # a fresh run each time this example runs
        dist.barrier()
        torch.manual_seed(100 + rank)
        model, optim = build(mesh, seed=0)
        uninterrupted = train(model, optim, range(args.steps), rank)

        torch.manual_seed(100 + rank)
        model, optim = build(mesh, seed=0)
        half = args.steps // 2
        losses: list[float] = []
        for start in range(0, half, args.every):
            losses += train(model, optim, range(start, start + args.every), rank)
            state = {"train": aiosnap.ShardedState(model, optim), "rng": aiosnap.RNGState(), "data": {"step": start}}
            handle = ckpt.save(state, step=start + args.every, rank_local=["rng", "data"])  # returns once captured
        handle.wait()  # committed: every rank's shards landed (training went on meanwhile)

        model, optim = build(mesh, seed=1234)  # "restarted": other weights, no optimizer state
        torch.manual_seed(9)
        state = {"train": aiosnap.ShardedState(model, optim), "rng": aiosnap.RNGState(), "data": {"step": -1}}
        ckpt.load(state)  # the latest step as rank 0 sees it, resharded if the job's size changed
        resumed_from = state["data"]["step"] + args.every
        losses += train(model, optim, range(resumed_from, args.steps), rank)
    same = losses == uninterrupted
    print(f"rank {rank}/{world}: resumed at step {resumed_from}; losses equal to an uninterrupted run: {same}")
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
