"""States of many small tensors: direct host copies, the remembered layout, the paused
garbage collector. Every shortcut must save exactly what the long way saves."""

from __future__ import annotations

import gc
import os
import threading
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from aiosnap import Config, SyncCheckpointer
from aiosnap.core.gcpause import gc_paused
from aiosnap.core.tensorio import host_address
from aiosnap.errors import UnsupportedStateError
from aiosnap.trainer.layout_memo import LayoutMemo
from aiosnap.trainer.plan import make_plan


def _checkpointer(root: Path) -> SyncCheckpointer:
    return SyncCheckpointer(Config(storage={"url": str(root)}, events={"log": False}))


def _odd_tensors() -> dict[str, torch.Tensor]:
    """Tensors whose bytes do not lie plainly in memory next to ones that do."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 8, generator=g)
    complex_values = torch.randn(5, dtype=torch.complex64, generator=g)
    return {
        "plain": torch.randn(33, generator=g),
        "offset_slice": base[2:4].reshape(-1),  # contiguous, inside a bigger storage
        "transposed": base.t(),  # strided
        "expanded": torch.randn(1, 4, generator=g).expand(3, 4),  # stride 0
        "conj_view": complex_values.conj(),  # lazy: the memory holds the unconjugated values
        "neg_view": torch._neg_view(torch.randn(7, generator=g)),  # lazy negation
        "zero_d": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "bool": torch.rand(17, generator=g) > 0.5,
        "bf16": torch.randn(9, generator=g).to(torch.bfloat16),
        "int64": torch.randint(-(2**40), 2**40, (11,), generator=g),
        "uint8": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g),
        "complex": complex_values,
        "f64_2d": torch.randn(3, 5, dtype=torch.float64, generator=g),
        "parameter": torch.nn.Parameter(torch.randn(6, generator=g)),
    }


def test_what_lies_plainly_in_host_memory_is_told_apart() -> None:
    odd = _odd_tensors()
    for name in ("plain", "offset_slice", "zero_d", "bool", "bf16", "int64", "uint8", "complex", "f64_2d", "parameter"):
        tensor = odd[name]
        assert host_address(tensor, tensor.nbytes) == tensor.data_ptr(), name
    for name in ("transposed", "expanded", "conj_view", "neg_view"):
        assert host_address(odd[name], odd[name].nbytes) == 0, name
    plain = odd["plain"]
    assert host_address(plain, plain.nbytes + 1) == 0  # asks for more than the tensor holds
    parameter = torch.nn.Parameter(plain.clone())
    assert host_address(parameter, 4) == parameter.data_ptr()

    class Tagged(torch.Tensor):
        pass

    assert host_address(plain.as_subclass(Tagged), 4) == 0  # a subclass may hold its bytes elsewhere


def test_direct_copies_save_exactly_what_torch_copies_save(tmp_path: Path) -> None:
    odd = _odd_tensors()
    with _checkpointer(tmp_path / "root") as ckpt:
        ckpt.save(odd, step=1).future.result(timeout=60)
        loaded = ckpt.load()
    assert loaded.keys() == odd.keys()
    for name, tensor in odd.items():
        want = tensor.detach().resolve_conj().resolve_neg()
        got = loaded[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)), name


def test_a_tensor_shrunk_after_planning_is_not_read_past_its_end(tmp_path: Path) -> None:
    """The copier asks the tensor as it is when it copies: a tensor resized smaller between
    planning and copying goes the checked (torch) way, which refuses, instead of a direct
    copy reading memory the tensor no longer owns, or a short copy leaving stale bytes."""
    tensor = torch.arange(4096, dtype=torch.float32)
    plan = make_plan({"t": tensor}, step=1, chunk_bytes=1 << 20)
    tensor.resize_(16)
    from aiosnap.trainer.capture import Copier

    slab = torch.zeros(1 << 20, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="resized while save"):
        Copier().copy(plan, plan.chunks[0], slab, None)


def test_a_chunk_larger_than_its_slab_is_refused_before_any_copy() -> None:
    plan = make_plan({"t": torch.ones(1024)}, step=1, chunk_bytes=1 << 20)
    from aiosnap.trainer.capture import Copier

    with pytest.raises(ValueError, match="does not fit"):
        Copier().copy(plan, plan.chunks[0], torch.zeros(100, dtype=torch.uint8), None)


def test_an_unchanged_table_reuses_the_last_layout() -> None:
    state = {f"t{i}": torch.randn(i % 7 + 1) for i in range(300)}
    memo = LayoutMemo()
    first = make_plan(state, step=1, chunk_bytes=4096, memo=memo)
    for tensor in state.values():
        tensor.add_(1)  # training changes values, not the table
    second = make_plan(state, step=2, chunk_bytes=4096, memo=memo)
    assert second.spec.entries is first.spec.entries  # taken as is
    assert [c.nbytes for c in second.chunks] == [c.nbytes for c in first.chunks]
    assert [c.object_name.split("/", 2)[2] for c in second.chunks] == [
        c.object_name.split("/", 2)[2] for c in first.chunks
    ]
    assert all(second.save_id in c.object_name for c in second.chunks)
    assert all(second.save_id in c.object_name for c in second.spec.chunks)
    fresh = make_plan(state, step=2, chunk_bytes=4096)
    assert second.spec.entries == fresh.spec.entries
    assert [c.pieces for c in second.spec.chunks] == [c.pieces for c in fresh.spec.chunks]


@pytest.mark.parametrize("change", ["resize_in_place", "new_tensor", "renamed", "tied", "chunk_size", "pickle"])
def test_any_change_to_the_table_lays_it_out_afresh(change: str) -> None:
    state: dict[str, object] = {f"t{i}": torch.randn(8) for i in range(50)}
    memo = LayoutMemo()
    chunk_bytes = 4096
    first = make_plan(state, step=1, chunk_bytes=chunk_bytes, memo=memo)
    if change == "resize_in_place":
        state["t3"].resize_(20)  # type: ignore[attr-defined]  # same object, new shape
    elif change == "new_tensor":
        state["t3"] = torch.randn(8, dtype=torch.float64)
    elif change == "renamed":
        state["renamed"] = state.pop("t3")
    elif change == "tied":
        state["t4"] = state["t3"]  # one entry fewer
    elif change == "chunk_size":
        chunk_bytes = 8192
    else:
        state["extra"] = {"a", "b"}  # a set is pickled: never remembered
    second = make_plan(state, step=2, chunk_bytes=chunk_bytes, memo=memo, pickle_values=True)
    assert second.spec.entries is not first.spec.entries
    fresh = make_plan(state, step=2, chunk_bytes=chunk_bytes, pickle_values=True)
    assert second.spec.entries == fresh.spec.entries
    assert [c.pieces for c in second.spec.chunks] == [c.pieces for c in fresh.spec.chunks]
    if change == "pickle":
        third = make_plan(state, step=3, chunk_bytes=chunk_bytes, memo=memo, pickle_values=True)
        assert third.spec.entries is not second.spec.entries


def test_saves_that_reuse_the_layout_load_their_own_values(tmp_path: Path) -> None:
    state = {f"layer{i}": torch.full((i % 5 + 1,), float(i)) for i in range(400)}
    with _checkpointer(tmp_path / "root") as ckpt:
        for step in range(1, 4):
            for tensor in state.values():
                tensor.add_(1)
            ckpt.save(state, step=step).future.result(timeout=60)
        state["layer7"].resize_(9).fill_(-1)  # the same tensor, a new shape: a new layout
        ckpt.save(state, step=4).future.result(timeout=60)
        third = ckpt.load(step=3)
        fourth = ckpt.load(step=4)
    for i in range(400):
        assert torch.equal(third[f"layer{i}"], torch.full((i % 5 + 1,), float(i + 3))), i
    assert torch.equal(fourth["layer7"], torch.full((9,), -1.0))
    assert torch.equal(fourth["layer8"], state["layer8"])


def test_the_remembered_layout_keeps_no_tensor_alive() -> None:
    memo = LayoutMemo()
    tensor = torch.randn(1000)
    ref = weakref.ref(tensor)
    plan = make_plan({"t": tensor}, step=1, chunk_bytes=1 << 20, memo=memo)
    del plan, tensor
    gc.collect()
    assert ref() is None
    assert memo.recall(1 << 20, [None], ["t"]) is None


def test_planning_pauses_the_collector_and_restores_it() -> None:
    seen: list[bool] = []

    class Probe:
        def state_dict(self) -> dict[str, object]:
            seen.append(gc.isenabled())
            return {"w": torch.ones(2)}

        def load_state_dict(self, state: dict[str, object]) -> None:
            pass

    assert gc.isenabled()
    make_plan({"probe": Probe()}, step=1, chunk_bytes=4096)
    assert seen == [False] and gc.isenabled()
    with pytest.raises(UnsupportedStateError):
        make_plan({"meta": torch.empty(3, device="meta")}, step=1, chunk_bytes=4096)
    assert gc.isenabled()  # back on after a refusal too
    gc.disable()
    try:
        make_plan({"probe": Probe()}, step=1, chunk_bytes=4096)
        assert not gc.isenabled()  # a caller that turned it off keeps it off
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("kind", ["folder", "single_file", "rank_local"])
def test_a_spec_crosses_to_the_upload_process_unchanged(kind: str) -> None:
    import pickle

    state = {f"t{i}": torch.randn(i % 4 + 1) for i in range(50)}
    state["big"] = torch.randn(3000)  # split over chunks
    state["odd"] = torch.randn(3, 4).t()
    state["empty"] = torch.empty(0)
    state["pickled"] = {"a", "b"}  # type: ignore[assignment]
    plan = make_plan(
        {"state": state, "rng": torch.ones(3)},
        step=7,
        chunk_bytes=4096,
        metadata={"epoch": 3},
        single_file=kind == "single_file",
        rank_local=("rng",) if kind == "rank_local" else (),
        pickle_values=True,
    )
    back = pickle.loads(pickle.dumps(plan.spec, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == plan.spec
    assert type(back.entries) is tuple and type(back.chunks[0].pieces) is tuple
    assert (back.archive is None) == (kind != "single_file")
    assert (back.distributed is None) == (kind != "rank_local")


@contextmanager
def _paused_on_another_thread() -> Iterator[None]:
    """A pause under way on another thread for as long as the block runs."""
    inside, leave = threading.Event(), threading.Event()

    def pausing() -> None:
        with gc_paused():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=pausing)
    thread.start()
    try:
        assert inside.wait(10)
        yield
    finally:
        leave.set()
        thread.join(10)


def test_overlapping_pauses_end_with_the_last_one() -> None:
    with _paused_on_another_thread():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the other thread's pause is still under way
    assert gc.isenabled()


def test_a_process_forked_during_a_pause_starts_with_the_collector_on() -> None:
    with _paused_on_another_thread():
        assert not gc.isenabled()
        read, write = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: a DataLoader worker, say
            try:
                with gc_paused():  # its own pauses work too
                    pass
                os.write(write, b"1" if gc.isenabled() else b"0")
            finally:
                os._exit(0)
        os.close(write)
        answer = os.read(read, 1)
        os.close(read)
        os.waitpid(pid, 0)
        assert answer == b"1"
    assert gc.isenabled()
