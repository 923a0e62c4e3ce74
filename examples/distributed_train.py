"""Multi-rank checkpoints: FSDP2 on CPU with gloo, saved by every rank, resumed.

Run with ``torchrun --nproc-per-node 2 examples/distributed_train.py [--root PATH]``.
Each rank trains a fully sharded model on its own batches for ``--steps`` more steps, resuming
from the latest checkpoint when there is one (``ckpt.load_latest``: every rank gets the same
step), and saves every ``--every`` steps (parameters and optimizer state as DTensor shards,
written once per shard; the RNG state and the data position per rank). Halfway (after the
save nearest the middle) it restarts: fresh objects resume from the latest checkpoint, and
the losses must equal those of an uninterrupted run from step 0. Run it again and it goes on
where the last run stopped. Works with any number of ranks, and loads checkpoints saved with
another number (the RNG state is then skipped, so the losses are not compared).
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
    parser.add_argument("--steps", type=int, default=40, help="steps to train in this run (a multiple of --every)")
    parser.add_argument("--every", type=int, default=10, help="steps between saves")
    args = parser.parse_args()
    saves = args.steps // args.every if args.every > 0 else 0
    if saves < 2 or args.steps % args.every:
        parser.error(f"--steps {args.steps} must be a multiple of --every {args.every}, at least twice it")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    config = {"storage": {"url": args.root}, "retention": {"keep_last": 2}, "events": {"log": rank == 0}}
    with aiosnap.SyncCheckpointer(config) as ckpt:  # every rank makes it: collective
        torch.manual_seed(100 + rank)
        model, optim = build(mesh, seed=0)
        state = {"train": aiosnap.ShardedState(model, optim), "rng": aiosnap.RNGState(), "data": {"step": 0}}
        same_world = not ckpt.steps() or ckpt.manifest().world_size == world  # resized: RNG states stay as they are
        done = ckpt.load_latest(state, skip_rank_local=not same_world)  # steps done so far; None on the first run
        start = 0 if done is None else done
        half, end = start + saves // 2 * args.every, start + args.steps  # the restart comes after a save
        losses: list[float] = []
        for first in range(start, half, args.every):
            losses += train(model, optim, range(first, first + args.every), rank)
            state["data"]["step"] = first + args.every
            handle = ckpt.save(state, step=first + args.every, rank_local=["rng", "data"])  # returns once captured
        handle.wait()  # committed: every rank's shards landed (training went on meanwhile)

        model, optim = build(mesh, seed=1234)  # "restarted": other weights, no optimizer state
        torch.manual_seed(9)
        state = {"train": aiosnap.ShardedState(model, optim), "rng": aiosnap.RNGState(), "data": {"step": -1}}
        resumed_from = ckpt.load_latest(state)  # the same step on every rank, resharded if the job's size changed
        assert resumed_from == state["data"]["step"] == half, (resumed_from, state["data"])
        for first in range(half, end, args.every):
            losses += train(model, optim, range(first, first + args.every), rank)
            state["data"]["step"] = first + args.every
            ckpt.save(state, step=first + args.every, rank_local=["rng", "data"]).wait()

    torch.manual_seed(100 + rank)  # the same job without checkpoints, from step 0
    model, optim = build(mesh, seed=0)
    uninterrupted = train(model, optim, range(end), rank)[start:]
    same = losses == uninterrupted
    verdict = f"losses equal to an uninterrupted run: {same}" if same_world else "(another world size: not compared)"
    print(f"rank {rank}/{world}: steps {start}-{end}, resumed at step {resumed_from}; {verdict}")
    dist.destroy_process_group()
    return 0 if same or not same_world else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
