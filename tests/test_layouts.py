"""Every parallelism layout torchtitan uses, on gloo (real processes, :mod:`layout_child`):
FSDP2 over tensor parallelism on a 2x2 mesh, pipeline stages (``torch.distributed.pipelining``)
over tensor parallelism and over data-parallel replicas with an embedding tied across
stages, expert-parallel layers, a key one rank alone holds, the TP+FSDP2 example; each
checkpoint resumed in other layouts (2 ranks, one process, another pipeline split) to the
losses of the uninterrupted run, its state bit-exact.

Launching ranks costs more than any layout's training: one job of 4 ranks saves every
layout (the module's fixture), one job of 2 ranks resumes them all.

The model trains in float64, the same step in every layout (:mod:`layout_model`): tensor
parallelism sums in another order, so losses agree to ~1e-15, not bit for bit; the state a
load restores is compared bit for bit with what the saving job held.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import ShardedState, SyncCheckpointer

import layout_model as lm
from dist_launch import ok, run_ranks
from layout_child import EXAMPLE_STEPS, EXPERTS, SAVED_AT, STEPS, expected_state, expert

pytestmark = pytest.mark.timeout(90)

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


LAYOUTS = ("tp_fsdp", "pp_tp", "pipeline")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every layout trained and saved by one job of 4 ranks: ``roots`` (one per layout, the
    example's, and two for the coinciding-paths check), ``work`` (the full states they
    saved) and each rank's results."""
    base = tmp_path_factory.mktemp("layouts")
    roots = {name: str(base / name) for name in (*LAYOUTS, "example", "coinciding-one", "coinciding-two")}
    work = base / "work"
    results = ok(run_ranks("save_all", 4, work, timeout=80, child=CHILD, roots=roots), work)
    return {"roots": roots, "work": work, "results": results, "base": base}


def test_every_layout_saved_by_four_ranks_trains_like_one_process(saved: dict[str, Any]) -> None:
    """``tp_fsdp``: a small transformer trained with TP+FSDP2 on a 2x2 mesh (its parameters
    ``(_StridedShard(0), Shard(0))``, ``(Shard(0), Shard(1))`` and FSDP2 shards of norms on
    two meshes); ``pp_tp``: 2 pipeline stages of tensor parallelism; ``pipeline``: PP=2 x
    DP=2, the head tied to the embedding, experts, a key only rank 3 holds."""
    results, roots = saved["results"], saved["roots"]
    for layout in LAYOUTS:
        reference = _reference(tied=layout == "pipeline")
        assert all(_close(r[layout]["losses"], reference) for r in results), (layout, results[0][layout], reference)
    tp_fsdp = _manifest(Path(roots["tp_fsdp"]))
    sharded = [e for e in tp_fsdp["entries"] if e["kind"] == "sharded"]
    assert any("_StridedShard" in p for p in results[0]["tp_fsdp"]["placements"]), results[0]["tp_fsdp"]
    assert len(sharded) > 20 and all(len(e["shards"]) in (2, 4) for e in sharded)
    # the norms' FSDP2 shards live on two meshes (one per TP rank): both are written, one kept
    stored = sum(e["nbytes"] for e in tp_fsdp["entries"])
    norms = sum(e["nbytes"] for e in tp_fsdp["entries"] if "norm" in e["path"])
    assert stored <= sum(r["tp_fsdp"]["nbytes"] for r in results) <= stored + norms
    pp_tp = _manifest(Path(roots["pp_tp"]))
    assert sum(r["pp_tp"]["nbytes"] for r in results) == sum(e["nbytes"] for e in pp_tp["entries"])  # once each

    pipeline = _manifest(Path(roots["pipeline"]))
    paths = [e["path"] for e in pipeline["entries"]]
    assert len(paths) == len(set(paths))  # the tied embedding (and its optimizer state) stored once
    assert "train/model/embed.weight" in paths and "probe" in paths
    assert {f"moe/experts.{i}.w" for i in range(EXPERTS)} <= set(paths)
    stored = sum(e["nbytes"] for e in pipeline["entries"])
    written = sum(r["pipeline"]["nbytes"] for r in results)
    embed = lm.VOCAB * lm.DIM * 8
    # the stages' two copies of the tied embedding (and of its two Adam moments) are both
    # written: one is unreferenced; everything else is written once
    assert stored <= written <= stored + 3 * embed + 1024, (stored, written)
    assert all("saved step 2 and 4" in r["example"] for r in results), results


def test_every_layout_resumes_on_two_ranks(saved: dict[str, Any], tmp_path: Path) -> None:
    """TP+FSDP2 and PP x TP into FSDP2 over 2 ranks (DP=2); the pipeline into 2 stages split
    after block 1, its 4 experts 2 per rank, the key only rank 3 held where rank 1 holds it
    now; the example on 2 ranks; DTensors at keys whose paths coincide."""
    roots, work = saved["roots"], saved["work"]
    resumed = ok(run_ranks("resume_all", 2, tmp_path, timeout=80, child=CHILD, roots=roots, saved=str(work)),
                 tmp_path)  # fmt: skip
    for layout in ("tp_fsdp", "pp_tp"):
        reference = _reference()
        for result in resumed:
            assert result[layout]["exact"], layout
            assert _close(result[layout]["losses"], reference[SAVED_AT:]), (layout, result[layout], reference)
    reference = _reference(tied=True)
    for result in resumed:
        found = result["pipeline"]
        assert found["pipeline_exact"] and found["experts"] and found["stacked"] and found["router"]
        assert found["probe"]
        assert _close(found["pipeline"], reference[SAVED_AT:]), (found["pipeline"], reference)
        assert result["example"] is True
        assert result["coinciding"] == {"one": True, "two": True}


def test_every_layout_resumes_in_one_process(saved: dict[str, Any]) -> None:
    """Each checkpoint into one process as full tensors, bit-exact, to the losses of the
    uninterrupted run; the example's, by running the example script itself."""
    roots, work = saved["roots"], saved["work"]
    for layout in LAYOUTS:
        tied = layout == "pipeline"
        exact, losses = _resume_here(Path(roots[layout]), work, layout, tied=tied)
        assert exact and _close(losses, _reference(tied=tied)[SAVED_AT:]), (layout, losses)
    with SyncCheckpointer({"storage": {"url": roots["pipeline"]}, **CONFIG}) as ckpt:
        full = ckpt.load(skip_rank_local=True)
    assert torch.equal(full["stacked"], torch.stack([expert(i) for i in range(EXPERTS)]))
    assert torch.equal(full["probe"], torch.arange(5.0) + 3) and full["step"] == 3
    example = Path(__file__).resolve().parent.parent / "examples" / "parallel_train.py"
    run = subprocess.run(
        [sys.executable, str(example), "--root", roots["example"], "--steps", str(EXAMPLE_STEPS), "--resume"],
        capture_output=True, text=True, timeout=60,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("AIOSNAP_")}, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert run.returncode == 0 and "losses equal to an uninterrupted run: True" in run.stdout, run.stdout + run.stderr
