"""Ranks of the parallel-layout tests (``test_layouts.py``), launched like :mod:`dist_child`
(``python layout_child.py SCENARIO RANK WORLD PORT WORKDIR PARAMS``).

One job of 4 ranks (:func:`save_all`) runs every saving layout in turn: each trains the model
of :mod:`layout_model` for 3 steps, saves step 3, writes the full state it saved
(``expected-<layout>-<n>.pt``) and trains on to step 6 (the uninterrupted run); then the
example (``examples/parallel_train.py``) trains and saves. One job of 2 ranks
(:func:`resume_all`) loads each checkpoint into another layout, returns whether the loaded
state is bit-exact and the losses of steps 3-5, resumes the example, and saves and loads
DTensors at keys whose paths coincide. (Launching ranks costs more than all of it: one job
per world size.)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import dist_child
import layout_model as lm
import parallel_train

SAVED_AT, STEPS = 3, 6
EXPERTS, EXPERT_SHAPE = 4, (3, 2)


def _config(root: str) -> dict[str, Any]:
    return {**dist_child.config(root), "ram_budget": "4MiB", "upload": {"chunk_size": "64KiB"}}


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _save(root: str, state: dict[str, Any], **kwargs: Any) -> int:
    import aiosnap

    with aiosnap.SyncCheckpointer(_config(root)) as ckpt:
        return int(ckpt.save(state, step=SAVED_AT, **kwargs).wait(timeout=40).nbytes)


def _load(root: str, state: dict[str, Any], **kwargs: Any) -> None:
    import aiosnap

    with aiosnap.SyncCheckpointer(_config(root)) as ckpt:
        ckpt.load(state, **kwargs)


def _placements(model: torch.nn.Module) -> list[str]:
    return sorted({str(p.placements) for p in model.parameters() if hasattr(p, "placements")})


def expert(index: int) -> torch.Tensor:
    return torch.arange(6.0).reshape(EXPERT_SHAPE) + 100 * index


def _experts(owned: list[int], mesh: Any, zero: bool = False) -> dict[str, Any]:
    """Experts as keys (this rank's own), a router every rank holds, and all experts as one
    tensor sharded on its expert dimension over ``mesh``."""
    from torch.distributed.tensor import Shard, distribute_tensor

    every = torch.stack([expert(i) for i in range(EXPERTS)])
    keys = {f"experts.{i}.w": torch.zeros(EXPERT_SHAPE) if zero else expert(i) for i in owned}
    return {
        "moe": {**keys, "router": torch.zeros(4) if zero else torch.linspace(0, 1, 4)},
        "stacked": distribute_tensor(torch.zeros_like(every) if zero else every, mesh, [Shard(0)]),
    }


def save_parallel(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """``tp_fsdp``: TP+FSDP2 on a (dp=2, tp=2) mesh; ``pp_tp``: 2 pipeline stages (blocks 0
    and 1-2) of tensor parallelism, a (pp=2, tp=2) mesh."""
    import aiosnap

    layout = params["layout"]
    if layout == "tp_fsdp":
        mesh = _mesh((2, 2), ("dp", "tp"))
        dp = mesh["dp"]
        model = lm.fully_sharded(lm.tensor_parallel(lm.build(), mesh["tp"]), dp)

        def train(steps: range) -> list[float]:
            return lm.train_data_parallel(model, optim, steps, dp.get_local_rank(), dp.get_group())

        writes = rank == 0
    else:
        mesh = _mesh((2, 2), ("pp", "tp"))
        stage = mesh["pp"].get_local_rank()
        model = lm.tensor_parallel(lm.stage_of(lm.build(), [0] if stage == 0 else [1, 2], stage == 0, stage == 1),
                                   mesh["tp"])  # fmt: skip

        def train(steps: range) -> list[float]:
            return lm.train_pipeline(model, optim, steps, stage, 2, mesh["pp"].get_group(), [0, 1])

        writes = mesh["tp"].get_local_rank() == 0
    optim = lm.optimizer(model)
    losses = train(range(SAVED_AT))
    nbytes = _save(params["root"], {"train": aiosnap.ShardedState(model, optim), "step": 3})
    expected = lm.full_state(model, optim)
    if writes:  # each stage's own (a stage holds part of the model)
        torch.save(expected, Path(work) / f"expected-{layout}-{rank}.pt")
    losses += train(range(SAVED_AT, STEPS))
    return {"losses": losses, "placements": _placements(model), "nbytes": nbytes}


def _tied_sync(model: lm.Tiny, replicas: Any, stages: Any) -> Any:
    """After a backward: average the gradients over data-parallel ``replicas``, and sum the
    tied embedding's over the pipeline ``stages`` that hold it (the first and the last)."""

    def sync() -> None:
        for param in model.parameters():
            if replicas is not None:
                dist.all_reduce(param.grad, group=replicas)
                param.grad /= dist.get_world_size(replicas)
        assert model.embed is not None
        dist.all_reduce(model.embed.weight.grad, group=stages)

    return sync


def save_pipeline(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """2 pipeline stages x 2 data-parallel replicas, the embedding tied to the output head
    across the stages; beside the model, an expert layer (experts as keys, one per rank, and
    as a tensor sharded on its expert dimension), a key only rank 3 holds, and per-rank values."""
    import aiosnap

    mesh = _mesh((2, 2), ("pp", "dp"))
    stage, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    model = lm.stage_of(lm.build(tied=True), [0] if stage == 0 else [1, 2], stage == 0, stage == 1)
    optim = lm.optimizer(model)
    stages, replicas = mesh["pp"].get_group(), mesh["dp"].get_group()
    sync = _tied_sync(model, replicas, stages)
    losses = lm.train_pipeline(model, optim, range(SAVED_AT), stage, 2, stages, [replica], sync, replicas)
    state: dict[str, Any] = {"train": aiosnap.ShardedState(model, optim), "step": 3, "data": {"position": 10 * rank}}
    state.update(_experts([rank], _mesh((world,), ("ep",))))
    if rank == 3:
        state["probe"] = torch.arange(5.0) + 3
    nbytes = _save(params["root"], state, rank_local=["data"])
    expected = lm.full_state(model, optim)
    if replica == 0:
        torch.save(expected, Path(work) / f"expected-pipeline-{stage}.pt")
    losses += lm.train_pipeline(model, optim, range(SAVED_AT, STEPS), stage, 2, stages, [replica], sync, replicas)
    return {"losses": losses, "nbytes": nbytes}


def expected_state(work: str, layout: str) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for path in sorted(Path(work).glob(f"expected-{layout}-*.pt")):
        found.update(torch.load(path, weights_only=True))
    return found


def same_as_saved(model: torch.nn.Module, optim: torch.optim.Optimizer, work: str, layout: str) -> bool:
    """The loaded model and optimizer hold, bit for bit, what the saving job held (the keys
    they have: a pipeline stage holds part of them)."""
    loaded, expected = lm.full_state(model, optim), expected_state(work, layout)
    return bool(loaded) and all(torch.equal(value, expected[key]) for key, value in loaded.items())


def resume_parallel(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """A TP+FSDP2 or PP x TP checkpoint into FSDP2 over 2 data-parallel ranks."""
    import aiosnap

    mesh = _mesh((2,), ("dp",))
    model = lm.fully_sharded(lm.build(seed=123), mesh)
    optim = lm.optimizer(model)
    state: dict[str, Any] = {"train": aiosnap.ShardedState(model, optim), "step": 0}
    _load(params["root"], state)
    exact = state["step"] == 3 and same_as_saved(model, optim, params["saved"], params["layout"])
    return {
        "exact": exact,
        "losses": lm.train_data_parallel(model, optim, range(SAVED_AT, STEPS), rank, mesh.get_group()),
    }


def resume_pipeline(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """The pipeline checkpoint into 2 stages split elsewhere, its experts 2 per rank."""
    import aiosnap

    root, saved, found = params["root"], params["saved"], {}
    mesh = _mesh((2,), ("ep",))
    model = lm.stage_of(lm.build(seed=123, tied=True), [0, 1] if rank == 0 else [2], rank == 0, rank == 1)
    optim = lm.optimizer(model)
    state = {"train": aiosnap.ShardedState(model, optim), **_experts([2 * rank, 2 * rank + 1], mesh, zero=True)}
    if rank == 1:
        state["probe"] = torch.zeros(5)
    _load(root, state, skip_rank_local=True)
    found["pipeline_exact"] = same_as_saved(model, optim, saved, "pipeline")
    experts = {int(k.split(".")[1]): v for k, v in state["moe"].items() if k.startswith("experts.")}
    found["experts"] = sorted(experts) == [2 * rank, 2 * rank + 1] and all(
        torch.equal(v, expert(i)) for i, v in experts.items()
    )
    local = state["stacked"].to_local()
    found["stacked"] = torch.equal(local, torch.stack([expert(2 * rank), expert(2 * rank + 1)]))
    found["router"] = torch.equal(state["moe"]["router"], torch.linspace(0, 1, 4))
    found["probe"] = rank == 0 or torch.equal(state["probe"], torch.arange(5.0) + 3)
    sync = _tied_sync(model, None, dist.group.WORLD)
    found["pipeline"] = lm.train_pipeline(model, optim, range(SAVED_AT, STEPS), rank, 2, dist.group.WORLD, [0, 1], sync)
    return found


EXAMPLE_STEPS = 4


def save_all(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """Every saving layout, one after the other, each to its own root (``params["roots"]``)."""
    roots = params["roots"]
    found = {layout: save_parallel(rank, world, work, {"root": roots[layout], "layout": layout})
             for layout in ("tp_fsdp", "pp_tp")}  # fmt: skip
    found["pipeline"] = save_pipeline(rank, world, work, {"root": roots["pipeline"]})
    found["example"] = parallel_train.train(roots["example"], EXAMPLE_STEPS, world, rank)
    return found


def resume_all(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """Every resume on 2 ranks, and DTensors at keys whose paths coincide."""
    roots, saved = params["roots"], params["saved"]
    found: dict[str, Any] = {
        layout: resume_parallel(rank, world, work, {"root": roots[layout], "saved": saved, "layout": layout})
        for layout in ("tp_fsdp", "pp_tp")
    }
    found["pipeline"] = resume_pipeline(rank, world, work, {"root": roots["pipeline"], "saved": saved})
    found["example"] = parallel_train.resume(roots["example"], EXAMPLE_STEPS, world, rank)[0]
    found["coinciding"] = {meshes: coinciding_paths(roots[f"coinciding-{meshes}"], meshes) for meshes in ("one", "two")}
    return found


def coinciding_paths(root: str, meshes: str) -> bool:
    """Two DTensors whose paths coincide (``"a/b"`` and ``a -> b``), on one mesh or on two:
    saved, then loaded into zeros of the same layout, each gets its own values."""
    from torch.distributed.tensor import Shard, distribute_tensor

    first = _mesh((2,), ("x",))
    second = _mesh((1, 2), ("y", "x")) if meshes == "two" else first
    places = [Shard(0), Shard(0)] if meshes == "two" else [Shard(0)]

    def state(zero: bool) -> dict[str, Any]:
        one = torch.zeros(4, 2) if zero else torch.full((4, 2), 1.0)
        two = torch.zeros(4, 2) if zero else torch.arange(8.0).reshape(4, 2)
        return {"a/b": distribute_tensor(one, first, [Shard(0)]), "a": {"b": distribute_tensor(two, second, places)}}

    _save(root, state(False))
    loaded = state(True)
    _load(root, loaded)
    return torch.equal(loaded["a/b"].full_tensor(), torch.full((4, 2), 1.0)) and torch.equal(
        loaded["a"]["b"].full_tensor(), torch.arange(8.0).reshape(4, 2)
    )


if __name__ == "__main__":
    dist_child.main(globals())
