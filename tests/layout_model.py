"""A tiny transformer-shaped model for the layout tests, and how each layout trains it.

Every layout computes the same training step (float64, so that changing the order of sums
across tensor-parallel ranks changes the loss by ~1e-15, not 1e-6): a step's batch is two
microbatches (seeded by step and index); data-parallel rank ``d`` takes microbatch ``d``,
a pipeline schedule takes both, one process averages both losses. So a run resumed in any
layout must reach the losses of an uninterrupted run in any other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, BLOCKS, SEQ, BATCH = 16, 8, 16, 3, 6, 4
DTYPE = torch.float64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM, dtype=DTYPE)
        self.up = nn.Linear(DIM, HIDDEN, dtype=DTYPE)
        self.down = nn.Linear(HIDDEN, DIM, dtype=DTYPE)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(self.norm(h))))


class Tiny(nn.Module):
    """Embedding, blocks, norm, output; pipeline stages delete what they do not hold
    (``embed``/``blocks.<i>``/``norm``/``output`` set to None or removed), keeping names."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.tied = tied
        self.embed: nn.Module | None = nn.Embedding(VOCAB, DIM, dtype=DTYPE)
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(BLOCKS)})
        self.norm: nn.Module | None = nn.LayerNorm(DIM, dtype=DTYPE)
        self.output: nn.Module | None = None if tied else nn.Linear(DIM, VOCAB, bias=False, dtype=DTYPE)
        self.first = self.last = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.first and self.embed is not None else x
        for block in self.blocks.values():
            h = block(h)
        if not self.last:
            return h
        assert self.norm is not None
        h = self.norm(h)
        if self.tied:
            assert self.embed is not None
            return F.linear(h, self.embed.weight)
        assert self.output is not None
        return self.output(h)


def build(seed: int = 0, tied: bool = False) -> Tiny:
    torch.manual_seed(seed)
    return Tiny(tied)


def stage_of(model: Tiny, blocks: list[int], first: bool, last: bool) -> Tiny:
    """``model`` cut down to one pipeline stage: ``blocks`` and the ends it holds (a tied
    embedding stays on the last stage too, as the output head's weight)."""
    for name in list(model.blocks):
        if int(name) not in blocks:
            del model.blocks[name]
    model.first, model.last = first, last
    if not first and not (last and model.tied):
        model.embed = None
    if not last:
        model.norm = model.output = None
    return model


def microbatch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + index)
    tokens = torch.randint(VOCAB, (BATCH // 2, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, foreach=False)


def train_whole(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    """One process: the mean of both microbatches' losses per step."""
    losses = []
    for step in steps:
        parts = [loss_of(model(x), y) for x, y in (microbatch(step, 0), microbatch(step, 1))]
        loss = (parts[0] + parts[1]) / 2
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def train_data_parallel(
    model: nn.Module, optim: torch.optim.Optimizer, steps: range, dp: int, group: Any
) -> list[float]:
    """FSDP2 (with or without tensor parallelism) over 2 data-parallel ranks: rank ``dp``
    takes microbatch ``dp``; the step's loss is the mean over the data-parallel group."""
    import torch.distributed as dist

    losses = []
    for step in steps:
        x, y = microbatch(step, dp)
        loss = loss_of(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        losses.append(mean.item() / 2)
    return losses


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state as full plain tensors, by name (collective for
    sharded models)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    found = {}
    for prefix, part in (
        ("model", get_model_state_dict(model, options=options)),
        ("optim", get_optimizer_state_dict(model, optim, options=options)),
    ):
        for key, value in part.items():
            if isinstance(value, torch.Tensor):
                full = value.full_tensor() if type(value).__name__ == "DTensor" else value
                found[f"{prefix}/{key}"] = full.detach().clone()
    return found


def tensor_parallel(model: Tiny, tp_mesh: Any) -> Tiny:
    """Megatron-style tensor parallelism over ``tp_mesh``: the embedding row-wise (by
    vocabulary), each block's up projection column-wise and down projection row-wise, the
    output column-wise (its logits replicated); norms stay whole on each rank."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {}
    if model.embed is not None and model.first:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate())
    if model.output is not None:
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    for name in model.blocks:
        plan[f"blocks.{name}.up"] = ColwiseParallel()
        plan[f"blocks.{name}.down"] = RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)
    return model


def fully_sharded(model: Tiny, dp_mesh: Any) -> Tiny:
    """FSDP2 over ``dp_mesh``: each block, then the rest."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def train_pipeline(
    model: Tiny,
    optim: torch.optim.Optimizer,
    steps: range,
    stage: int,
    stages: int,
    pp_group: Any,
    batches: list[int],
    sync: Any = None,
    replicas: Any = None,
) -> list[float]:
    """``torch.distributed.pipelining`` (GPipe, one microbatch per entry of ``batches``, the
    microbatches of a step taken in order): rank ``stage`` of the pipeline group runs its
    stage; ``sync()`` runs after the backward (gradients of replicas, tied weights). The
    step's loss (the mean over microbatches, and over the data-parallel ``replicas`` group)
    from the last stage, for every rank of it."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    pipe = PipelineStage(model, stage, stages, torch.device("cpu"), group=pp_group)
    schedule = ScheduleGPipe(pipe, n_microbatches=len(batches), loss_fn=loss_of)
    last = dist.get_global_rank(pp_group, stages - 1)
    losses = []
    for step in steps:
        pairs = [microbatch(step, index) for index in batches]
        x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        found: list[torch.Tensor] = []
        if stage == 0:
            schedule.step(x)
        elif stage == stages - 1:
            schedule.step(target=y, losses=found)
        else:
            schedule.step()
        if sync is not None:
            sync()
        optim.step()
        optim.zero_grad()
        loss = torch.stack(found).mean().detach() if found else torch.zeros((), dtype=DTYPE)
        dist.broadcast(loss, src=last, group=pp_group)
        if replicas is not None:
            dist.all_reduce(loss, group=replicas)
            loss /= dist.get_world_size(replicas)
        losses.append(loss.item())
    return losses
