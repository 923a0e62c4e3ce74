"""Every parallelism layout torchtitan uses, on gloo (real processes, :mod:`layout_child`):
FSDP2 over tensor parallelism on a 2x2 mesh, pipeline stages (``torch.distributed.pipelining``)
over tensor parallelism and over data-parallel replicas with an embedding tied across
stages, expert-parallel layers, a key one rank alone holds; each checkpoint resumed in
other layouts (2 ranks, one process, another pipeline split) to the losses of the
uninterrupted run, its state bit-exact.

The model trains in float64, the same step in every layout (:mod:`layout_model`): tensor
parallelism sums in another order, so losses agree to ~1e-15, not bit for bit; the state a
load restores is compared bit for bit with what the saving job held.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import ShardedState, SyncCheckpointer

import layout_model as lm
from dist_launch import ok, run_ranks
from layout_child import EXPERTS, SAVED_AT, STEPS, expected_state, expert

pytestmark = pytest.mark.timeout(120)

CHILD = Path(__file__).resolve().parent / "layout_child.py"
CONFIG = {"events": {"log": False}}


def _close(found: list[float], expected: list[float]) -> bool:
    if len(found) != len(expected):
        return False
    return all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(found, expected, strict=True))


def _reference(tied: bool = False) -> list[float]:
    """The uninterrupted run in one process."""
    model = lm.build(tied=tied)
    return lm.train_whole(model, lm.optimizer(model), range(STEPS))


def _resume_here(root: Path, work: Path, layout: str, tied: bool = False) -> tuple[bool, list[float]]:
    """Load ``root`` into one process (a plain model: full tensors), train to the end."""
    model = lm.build(seed=123, tied=tied)
    optim = lm.optimizer(model)
    with SyncCheckpointer({"storage": {"url": str(root)}, **CONFIG}) as ckpt:
        ckpt.load({"train": ShardedState(model, optim)}, skip_rank_local=True)
    loaded, expected = lm.full_state(model, optim), expected_state(str(work), layout)
    exact = sorted(loaded) == sorted(expected) and all(torch.equal(v, expected[k]) for k, v in loaded.items())
    return exact, lm.train_whole(model, optim, range(SAVED_AT, STEPS))


def _manifest(root: Path) -> dict[str, Any]:
    return json.loads(next(root.glob("*/manifest.json")).read_text())


@pytest.mark.parametrize("layout", ["tp_fsdp", "pp_tp"])
def test_tensor_parallel_layouts_resume_as_dp2_and_in_one_process(tmp_path: Path, layout: str) -> None:
    """``tp_fsdp``: a small transformer trained with TP+FSDP2 on a 2x2 mesh (its parameters
    ``(_StridedShard(0), Shard(0))``, ``(Shard(0), Shard(1))`` and FSDP2 shards of norms on
    two meshes); ``pp_tp``: 2 pipeline stages of tensor parallelism. Saved by 4 ranks,
    resumed on 2 ranks as FSDP2 (DP=2) and in one process as full tensors."""
    root, work = tmp_path / "root", tmp_path / "work"
    saved = ok(run_ranks("save_parallel", 4, work, timeout=90, child=CHILD, root=str(root), layout=layout), work)
    reference = _reference()
    assert all(_close(r["losses"], reference) for r in saved), (saved[0]["losses"], reference)
    doc = _manifest(root)
    sharded = [e for e in doc["entries"] if e["kind"] == "sharded"]
    stored = sum(e["nbytes"] for e in doc["entries"])
    if layout == "tp_fsdp":
        assert any("_StridedShard" in p for p in saved[0]["placements"]), saved[0]["placements"]
        assert len(sharded) > 20 and all(len(e["shards"]) in (2, 4) for e in sharded)
        # the norms' FSDP2 shards live on two meshes (one per TP rank): both are written, one kept
        norms = sum(e["nbytes"] for e in doc["entries"] if "norm" in e["path"])
        assert stored <= sum(r["nbytes"] for r in saved) <= stored + norms
    else:
        assert sum(r["nbytes"] for r in saved) == stored  # every box written once

    resumed = ok(run_ranks("resume_parallel", 2, tmp_path / "two", child=CHILD, root=str(root), saved=str(work),
                           layout=layout), tmp_path / "two")  # fmt: skip
    for result in resumed:
        assert result["exact"]
        assert _close(result["losses"], reference[SAVED_AT:]), (result["losses"], reference)
    exact, losses = _resume_here(root, work, layout)
    assert exact and _close(losses, reference[SAVED_AT:]), (losses, reference)


def test_pipeline_stages_resume_as_one_stage_and_another_split(tmp_path: Path) -> None:
    """PP=2 x DP=2 (stage 0: block 0; stage 1: blocks 1-2 and the head tied to the
    embedding) resumed as PP=2 on 2 ranks split after block 1, and as one stage; the expert
    layer of 4 experts (one per rank, as keys and as a sharded expert dimension) as 2 per
    rank; the key only rank 3 held, where rank 1 holds it now."""
    root, work = tmp_path / "root", tmp_path / "work"
    saved = ok(run_ranks("save_pipeline", 4, work, timeout=90, child=CHILD, root=str(root)), work)
    reference = _reference(tied=True)
    assert all(_close(r["losses"], reference) for r in saved), (saved[0]["losses"], reference)

    doc = _manifest(root)
    paths = [e["path"] for e in doc["entries"]]
    assert len(paths) == len(set(paths))  # the tied embedding (and its optimizer state) stored once
    assert "train/model/embed.weight" in paths and "probe" in paths
    assert {f"moe/experts.{i}.w" for i in range(EXPERTS)} <= set(paths)
    stored = sum(e["nbytes"] for e in doc["entries"])
    written = sum(r["nbytes"] for r in saved)
    embed = lm.VOCAB * lm.DIM * 8
    # the stages' two copies of the tied embedding (and of its two Adam moments) are both
    # written: one is unreferenced; everything else is written once
    assert stored <= written <= stored + 3 * embed + 1024, (stored, written)

    resumed = ok(
        run_ranks("resume_pipeline", 2, tmp_path / "two", child=CHILD, root=str(root), saved=str(work)),
        tmp_path / "two",
    )
    for result in resumed:
        assert result["pipeline_exact"] and result["experts"] and result["stacked"] and result["router"]
        assert result["probe"]
        assert _close(result["pipeline"], reference[SAVED_AT:]), (result["pipeline"], reference)
    exact, losses = _resume_here(root, work, "pipeline", tied=True)
    assert exact and _close(losses, reference[SAVED_AT:]), (losses, reference)
    with SyncCheckpointer({"storage": {"url": str(root)}, **CONFIG}) as ckpt:
        full = ckpt.load(skip_rank_local=True)
    assert torch.equal(full["stacked"], torch.stack([expert(i) for i in range(EXPERTS)]))
    assert torch.equal(full["probe"], torch.arange(5.0) + 3) and full["step"] == 3


def _run_example(example: Path, world: int, *args: str) -> list[str]:
    """Run ``example`` on ``world`` ranks with the variables torchrun sets (env:// rendezvous
    on a free port; no elastic agent), each rank's output."""
    import os
    import subprocess
    import sys

    from dist_launch import free_port

    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("AIOSNAP_")}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(example), *args],
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=80)
            assert proc.returncode == 0, out[-3000:]
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


def test_the_parallel_example_resumes_tp_fsdp2_on_another_world_size(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "parallel_train.py"
    root = str(tmp_path / "root")
    trained = _run_example(example, 4, "--root", root)
    assert all("saved step 4 and 8" in out for out in trained), trained
    resumed = _run_example(example, 2, "--root", root, "--resume")
    assert all("losses equal to an uninterrupted run: True" in out for out in resumed), resumed
