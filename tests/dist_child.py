"""One rank of a multi-rank test: ``python dist_child.py SCENARIO RANK WORLD PORT WORKDIR PARAMS``.

Joins a gloo job on 127.0.0.1:PORT, runs the scenario function of that name, and writes
``WORKDIR/result-RANK.json``: what the scenario returned, or the exception it raised (type
and message). Launched by :func:`dist_launch.run_ranks`, which kills what is left after its
timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

QUICK = {"commit_timeout": 30, "agree_timeout": 30}


def config(root: str, s3: dict[str, Any] | None = None, executor: str = "thread", **distributed: Any) -> dict[str, Any]:
    return {
        "storage": {"url": root},
        **({"s3": s3} if s3 else {}),
        "ram_budget": "64MiB",
        "upload": {"chunk_size": "1MiB", "executor": executor},
        "retention": {"keep_last": None},
        "events": {"log": False},
        "distributed": {**QUICK, **distributed},
    }


def arange(shape: list[int], dtype: torch.dtype = torch.float32, base: float = 0.0) -> torch.Tensor:
    return (torch.arange(int(torch.tensor(shape).prod().item()), dtype=torch.float64) + base).to(dtype).reshape(shape)


def placements_of(spec: list[str]) -> list[Any]:
    """``"R"``, ``"S<dim>"``, ``"SS<dim>:<split factor>"`` (``_StridedShard``) placements."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    def one(p: str) -> Any:
        if p == "R":
            return Replicate()
        if p.startswith("SS"):
            dim, factor = p[2:].split(":")
            return _StridedShard(int(dim), split_factor=int(factor))
        return Shard(int(p[1:]))

    return [one(p) for p in spec]


def known(name: str, layout: list[Any], index: int) -> torch.Tensor:
    """The full tensor a layout ``[shape, mesh shape, placements(, dtype)]`` holds: known values."""
    dtype = getattr(torch, layout[3]) if len(layout) > 3 else torch.float32
    values = arange(layout[0], dtype=torch.float64, base=1000.0 * index)
    return (values.remainder(3) == 0) if dtype == torch.bool else values.to(dtype)


def expected_of(layouts: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {name: known(name, layout, i) for i, (name, layout) in enumerate(sorted(layouts.items()))}


def dtensors(layouts: dict[str, Any], zero: bool = False) -> dict[str, Any]:
    """{name: [shape, mesh shape, placements such as ["S0"], ["R", "S1"](, dtype)]} as
    DTensors of known values (:func:`known`), or zeros."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    found = {}
    for name, full in expected_of(layouts).items():
        _, mesh_shape, spec = layouts[name][:3]
        mesh = init_device_mesh("cpu", tuple(mesh_shape))
        found[name] = distribute_tensor(torch.zeros_like(full) if zero else full, mesh, placements_of(spec))
    return found


class CountingStorage:
    """Counts the bytes a load reads (wraps a LocalStorage's read_scatter)."""

    @staticmethod
    def wrap(root: str) -> Any:
        from aiosnap.storage.local import LocalStorage

        class Counting(LocalStorage):
            read_bytes = 0

            async def read_scatter(self, name: str, offset: int, buffers: Any) -> int:
                type(self).read_bytes += sum(len(b) for b in buffers)
                return await super().read_scatter(name, offset, buffers)

        return Counting(root)


# --- scenarios: (rank, world, workdir, params) -> JSON-able result


def ddp_roundtrip(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    import aiosnap

    torch.manual_seed(0)  # every rank the same replicated model, as DDP keeps it
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 64)).sum().backward()
    optim.step()
    torch.manual_seed(100 + rank)  # per-rank RNG streams
    rng = aiosnap.RNGState()
    state = {"model": model, "optim": optim, "rng": rng, "loader": {"position": 10 * rank}, "epoch": 3}
    with aiosnap.SyncCheckpointer(config(params["root"], executor=params.get("executor", "thread"))) as ckpt:
        result = ckpt.save(state, step=7, rank_local=["rng", "loader"]).wait(timeout=40)
        after_save = torch.rand(3).tolist()
        torch.manual_seed(0)
        fresh = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        torch.nn.init.zeros_(fresh[0].weight)
        fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.01)
        target = {"model": fresh, "optim": fresh_optim, "rng": aiosnap.RNGState(), "loader": {"position": -1}}
        ckpt.load(target)
        restored_draw = torch.rand(3).tolist()
    same_model = all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True)
    )
    same_optim = all(
        torch.equal(a, b)
        for s, t in zip(optim.state.values(), fresh_optim.state.values(), strict=True)
        for a, b in zip(s.values(), t.values(), strict=True)
    )
    return {
        "committed": result.step,
        "nbytes": result.nbytes,
        "same_model": same_model,
        "same_optim": same_optim and len(fresh_optim.state) == len(optim.state),
        "position": target["loader"]["position"],
        "rng_restored": restored_draw == after_save,
    }


def save_dtensors(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    import aiosnap

    state = {"dt": dtensors(params["layouts"]), "plain": arange([5, 3], base=-50.0)}
    with aiosnap.SyncCheckpointer(config(params["root"], params.get("s3"))) as ckpt:
        result = ckpt.save(state, step=params.get("step", 1)).wait(timeout=40)
    return {"nbytes": result.nbytes}


def load_dtensors(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    import aiosnap

    targets = dtensors(params["layouts"], zero=True)
    expected = expected_of(params["layouts"])
    storage = None if params.get("s3") else CountingStorage.wrap(params["root"])
    state = {"dt": targets, "plain": torch.zeros(5, 3)}
    locals_before = {name: t.to_local().data_ptr() for name, t in targets.items()}
    with aiosnap.SyncCheckpointer(config(params["root"], params.get("s3")), storage=storage) as ckpt:
        ckpt.load(state)
    equal = {name: bool(torch.equal(t.full_tensor(), expected[name])) for name, t in targets.items()}
    in_place = all(targets[n].to_local().data_ptr() == p for n, p in locals_before.items())
    local_bytes = sum(t.to_local().numel() * t.to_local().element_size() for t in targets.values())
    return {
        "equal": equal,
        "plain": bool(torch.equal(state["plain"], arange([5, 3], base=-50.0))),
        "in_place": in_place,
        "read_bytes": None if storage is None else type(storage).read_bytes,
        "local_bytes": local_bytes,
    }


def fsdp_resume(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    import aiosnap
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[float]:
        losses = []
        for step in steps:
            generator = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch
            x = torch.randn(8, 16, generator=generator)
            loss = (model(x) - torch.rand(8, 4)).pow(2).mean()  # the global RNG: rank-local state
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        return losses

    torch.manual_seed(50 + rank)
    model, optim = build(0)
    uninterrupted = train(model, optim, range(8))
    torch.manual_seed(50 + rank)
    model, optim = build(0)
    first = train(model, optim, range(4))
    cfg = config(params["root"])
    with aiosnap.SyncCheckpointer(cfg) as ckpt:
        state = {"train": aiosnap.ShardedState(model, optim), "rng": aiosnap.RNGState()}
        ckpt.save(state, step=4, rank_local=["rng"]).wait(timeout=40)
    model, optim = build(123)  # a restarted job: other weights, no optimizer state yet
    torch.manual_seed(999)
    with aiosnap.SyncCheckpointer(cfg) as ckpt:
        ckpt.load({"train": aiosnap.ShardedState(model, optim), "rng": aiosnap.RNGState()})
    resumed = first + train(model, optim, range(4, 8))
    return {"uninterrupted": uninterrupted, "resumed": resumed}


def fail_or_vanish(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """Step 1 commits; in step 2 rank ``params["victim"]`` fails its data writes (``how``:
    "error") or is killed while they hang ("kill"), or never calls save() ("skip")."""
    import asyncio

    import aiosnap
    from aiosnap.storage.local import LocalStorage

    victim, how = params["victim"], params["how"]

    class Failing(LocalStorage):
        async def write(self, name: str, data: Any, *, if_absent: bool = False) -> None:
            if rank == victim and name.startswith("000000000002/") and name.endswith(".bin"):
                if how == "error":
                    raise OSError(28, "No space left on device (injected)")
                await asyncio.sleep(3600)
            await super().write(name, data, if_absent=if_absent)

    cfg = config(params["root"], commit_timeout=params["commit_timeout"], agree_timeout=params["agree_timeout"])
    state = {"w": arange([256, 64], base=float(rank == 0)), "r": torch.zeros(3)}
    ckpt = aiosnap.SyncCheckpointer(cfg, storage=Failing(params["root"]))
    ckpt.save(state, step=1).wait(timeout=40)
    if rank == victim and how == "skip":
        time.sleep(params["agree_timeout"] + 3)  # the others give up on this rank meanwhile
        os._exit(0)
    state["w"].add_(1)  # new bytes: step 2 writes data objects (the same bytes would all be referenced)
    state["r"].add_(1)
    started = time.monotonic()
    try:
        handle = ckpt.save(state, step=2)
        if rank == victim and how == "kill":
            os._exit(9)  # killed with its upload in flight
        handle.wait(timeout=60)
        outcome = "committed"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - started
    steps = ckpt.steps()
    with contextlib.suppress(Exception):  # the failure was reported above
        ckpt.close(timeout=5)
    return {"outcome": outcome, "elapsed": elapsed, "steps": steps}


def early_failure(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 cannot start a save: its state cannot be saved ("state"), or an earlier save of
    its own failed and nobody waited for it ("earlier"). Rank 0 must hear of it at once."""
    import asyncio

    import aiosnap
    from aiosnap.storage.local import LocalStorage

    class Failing(LocalStorage):
        async def write(self, name: str, data: Any, *, if_absent: bool = False) -> None:
            if rank == 1 and name.startswith("000000000002/") and name.endswith(".bin"):
                raise OSError(28, "No space left on device (injected)")
            await super().write(name, data, if_absent=if_absent)

    cfg = config(params["root"], commit_timeout=30, agree_timeout=30)
    state: dict[str, Any] = {"w": torch.ones(64), "v": torch.ones(64)}  # one for each rank to write
    outcomes = []
    ckpt = aiosnap.SyncCheckpointer(cfg, storage=Failing(params["root"]))
    ckpt.save(state, step=1).wait(timeout=40)
    if params["how"] == "earlier":
        state = {"w": state["w"] + 1, "v": state["v"] + 1}  # new bytes: step 2 writes data objects
        handle = ckpt.save(state, step=2)
        if rank == 0:
            with contextlib.suppress(Exception):
                handle.wait(timeout=40)  # observed here; rank 1 leaves its failure unobserved
        else:
            asyncio.run(asyncio.sleep(1.0))
    elif rank == 1:
        state = {"w": torch.ones(64).to_sparse(), "v": torch.ones(64)}  # cannot be saved
    started = time.monotonic()
    try:
        ckpt.save(state, step=3).wait(timeout=40)
        outcomes.append("committed")
    except Exception as exc:
        outcomes.append(f"{type(exc).__name__}: {exc}")
    elapsed = time.monotonic() - started
    steps = ckpt.steps()
    with contextlib.suppress(Exception):
        ckpt.close(timeout=5)
    return {"outcome": outcomes[0], "elapsed": elapsed, "steps": steps}


def cancel_while_committing(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """The coordinator's ``await ckpt.save(...)`` is cancelled after aiosnap's loop has taken
    the save over and while its manifest is being written (a slow store; the caller's own
    loop busy, so the cancel lands late): the commit must stand whole."""
    import asyncio

    import aiosnap
    from aiosnap.storage.local import LocalStorage

    class SlowManifest(LocalStorage):
        async def write(self, name: str, data: Any, *, if_absent: bool = False) -> None:
            if rank == 0 and name == "000000000002/manifest.json":
                await asyncio.sleep(5)
            await super().write(name, data, if_absent=if_absent)

    state = {"w": arange([256, 64], base=float(rank)), "v": arange([256, 64])}
    outcome: dict[str, Any] = {}

    async def main() -> None:
        ckpt = aiosnap.Checkpointer(config(params["root"], commit_timeout=20), storage=SlowManifest(params["root"]))
        await (await ckpt.save(state, step=1))
        if rank == 0:
            task = asyncio.ensure_future(ckpt.save(state, step=2))
            await asyncio.sleep(0)  # agreement done, the save handed to aiosnap's loop
            time.sleep(2.5)  # noqa: ASYNC251 - the caller's loop is busy: the cancel comes late
            task.cancel()
            try:
                await (await task)
                outcome["save"] = "committed"
            except BaseException as exc:
                outcome["save"] = type(exc).__name__
        else:
            try:
                await (await ckpt.save(state, step=2)).wait(timeout=40)
                outcome["save"] = "committed"
            except Exception as exc:
                outcome["save"] = f"{type(exc).__name__}: {exc}"
        for _ in range(150):  # until the manifest lands (rank 0's store takes 5 s for it)
            outcome["steps"] = await ckpt.steps()
            if outcome["steps"] == [1, 2]:
                break
            await asyncio.sleep(0.1)
        with contextlib.suppress(Exception):
            await ckpt.close(timeout=10)

    asyncio.run(main())
    return outcome


def disagree(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    import aiosnap

    state = {"model": {"a": torch.zeros(4), "b": torch.zeros(3 if rank == 0 else 5)}}
    with aiosnap.SyncCheckpointer(config(params["root"])) as ckpt:
        try:  # the ranks may hold different keys: the coordinator's merge finds the conflict
            ckpt.save(state, step=1).wait(timeout=40)
            return {"outcome": "saved"}
        except Exception as exc:
            return {"outcome": f"{type(exc).__name__}: {exc}", "steps": ckpt.steps()}


def mismatched_calls(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """After a save together, rank 0 saves while rank 1 loads ("save_load"), or the ranks
    declare different rank-local paths ("rank_local")."""
    import aiosnap

    state: dict[str, Any] = {"a": 100 + rank, "b": 200 + rank, "w": torch.ones(4)}
    with aiosnap.SyncCheckpointer(config(params["root"], agree_timeout=20)) as ckpt:
        ckpt.save(state, step=1).wait(timeout=40)
        try:
            if params["how"] == "rank_local":
                ckpt.save(state, step=2, rank_local=["a"] if rank == 0 else ["b"]).wait(timeout=40)
            elif rank == 0:
                ckpt.save(state, step=2).wait(timeout=40)
            else:
                ckpt.load({"w": torch.zeros(4)})
            outcome = "done"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        return {"outcome": outcome, "steps": ckpt.steps()}


def events_in_subgroup(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    import aiosnap

    members = params["members"]
    group = dist.new_group(members)  # collective over the whole world
    if rank not in members:
        dist.barrier()
        return {"member": False}
    seen: list[Any] = []
    with aiosnap.SyncCheckpointer(config(params["root"]), process_group=group, event_handlers=[seen.append]) as ckpt:
        ckpt.save({"w": torch.ones(8)}, step=1).wait(timeout=40)
        ckpt.flush_events()
    dist.barrier()
    return {
        "member": True,
        "seen": sorted({(e.rank, e.world_size, e.backend, e.group_size) for e in seen}),
    }


def preempted(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """Each rank gets its own SIGTERM (sent to itself, at a different step on each rank, as
    ranks notice a cluster's signal at different moments), the ranks agree on it every four
    steps over the job's group, and all take one last save at the same step."""
    import signal

    import aiosnap

    settings = {**config(params["root"]), "preemption": {"enabled": True, "grace_period": 30}}
    state = {"w": torch.full((1000,), float(rank)), "step": 0}
    with aiosnap.SyncCheckpointer(settings) as ckpt:
        for step in range(100):
            state["step"] = step
            if step == 1 + rank:
                os.kill(os.getpid(), signal.SIGTERM)  # the cluster's signal reaches this rank
            if step % 4 == 0:  # the docs' agreement (docs/guides/preemption.md, multi-rank)
                flag = torch.tensor([1 if ckpt.preempted else 0])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item():
                    ckpt.save(state, step=step, rank_local=["w"]).wait(timeout=40)
                    return {"last": step, "preempted": ckpt.preempted, "steps": ckpt.steps()}
            time.sleep(0.01)  # one training step
    raise AssertionError("never preempted")


def main(scenarios: dict[str, Any] | None = None) -> None:
    """Run the scenario named on the command line (a function of ``scenarios``, this
    module's own by default: :mod:`layout_child` passes its own)."""
    scenario, rank, world, port, work, raw = sys.argv[1:7]
    params = json.loads(raw)
    out = Path(work) / f"result-{rank}.json"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(rank), world_size=int(world),
        timeout=__import__("datetime").timedelta(seconds=60),
    )  # fmt: skip
    try:
        table = scenarios or globals()
        if scenario in table:
            run = table[scenario]
        else:
            import dist_verdicts

            run = getattr(dist_verdicts, scenario)
        result = {"ok": run(int(rank), int(world), work, params)}
    except BaseException as exc:
        result = {"error": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()}
    out.write_text(json.dumps(result))
    if params.get("hard_exit"):  # a rank of the job was killed: torch's teardown may wait for it
        os._exit(0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
