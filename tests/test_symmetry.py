"""Write/read symmetry: ``save()`` refuses a state on the caller's thread with a typed error,
or the save commits a manifest that ``load()`` reads back (issue 20, part 1).

Each case here was accepted by ``save()`` and then failed in the background with a raw
pydantic error, or committed a manifest every reader refuses (and retention then deleted
the last good step)."""

from __future__ import annotations

import enum
import io
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from aiosnap import Config, SyncCheckpointer
from aiosnap.core.names import MANIFEST_FILE, step_dir
from aiosnap.errors import ManifestError, StepOrderError, UnsupportedStateError
from aiosnap.format.manifest import MAX_MANIFEST_BYTES, Manifest
from aiosnap.trainer import manifest_size, plan
from tests.conftest import assert_same


class Mode(enum.StrEnum):
    TRAIN = "train"


class Counter:
    """A Stateful object, used as a dict key."""

    def __init__(self) -> None:
        self.n = 1

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Counter) and other.n == self.n

    def __hash__(self) -> int:
        return self.n


class Holder:
    """A user object holding tensors of the dtypes plain pickle cannot load back."""

    def __init__(self) -> None:
        self.tensors = {
            "u16": torch.tensor([1, 65535]).to(torch.uint16),
            "u32": torch.tensor([2**32 - 1]).to(torch.uint32),
            "u64": torch.tensor([2**40]).to(torch.uint64),
            "f8": torch.randn(5).to(torch.float8_e4m3fn),
            "c32": torch.randn(3, dtype=torch.complex64).to(torch.complex32),
            "view": torch.arange(12).to(torch.uint16).reshape(3, 4).t(),
        }


def _config(tmp_path: Path, **fields: Any) -> Config:
    return Config(storage={"url": str(tmp_path / "ckpt")}, ram_budget="1MiB", upload={"chunk_size": "64KiB"}, **fields)


def _only_pickle_stores() -> dict[str, Any]:
    """A value of every kind a manifest cannot hold as JSON, each under its own key."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "'mkldnn' is no longer used as device type"
        mkldnn = torch.device("mkldnn")
    return {
        "set": {1, 2},
        "np_str": np.str_("a"),
        "np_key": {np.str_("k"): 1},
        "enum": Mode.TRAIN,
        "enum_key": {Mode.TRAIN: 2},
        "surrogate": "file-\udcff",
        "surrogate_key": {"\ud800": 3},
        "size": torch.Size([-1, 3]),
        "device": mkldnn,
        "stateful_key": {Counter(): 4},
        "big_int": 10**5000,
        "generator": torch.Generator().manual_seed(3),
        "buffer": io.BytesIO(b"abc"),
        "held": Holder(),
    }


def _same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Generator):
        assert torch.equal(a.get_state(), b.get_state())
    elif isinstance(a, io.BytesIO):
        assert a.getvalue() == b.getvalue()
    elif isinstance(a, Holder):
        assert_same(a.tensors, b.tensors)
    else:
        assert_same(a, b)


def test_values_only_pickle_stores_are_refused_by_save_unless_pickles_are_allowed(tmp_path: Path) -> None:
    state = {"w": torch.ones(3), **_only_pickle_stores()}
    with SyncCheckpointer(_config(tmp_path)) as ckpt:
        with pytest.raises(UnsupportedStateError) as refused:
            ckpt.save(state, step=1)
        assert ckpt.steps() == []
    message = str(refused.value)
    for path in (
        "'set' (a set)",
        "'np_str' (a numpy.str_)",
        "'np_key/k' (a numpy.str_)",
        f"'enum' (a {Mode.__module__}.Mode)",
    ):
        assert path in message
    assert "'surrogate_key/\\\\ud800' (a key with lone surrogates)" in message and "and 4 more" in message
    assert "14 value(s)" in message and "pickle_values: true" in message and "allow_pickle=True" in message
    with SyncCheckpointer(_config(tmp_path, pickle_values=True)) as ckpt:
        ckpt.save(state, step=1).wait()
        loaded = ckpt.load(allow_pickle=True)
    assert list(loaded) == list(state)
    for key, value in state.items():
        _same(loaded[key], value)
    assert type(loaded["np_str"]) is np.str_ and type(next(iter(loaded["enum_key"]))) is Mode


def test_what_the_tree_holds_as_json_loads_back_as_it_was(tmp_path: Path) -> None:
    odict: OrderedDict[str, int] = OrderedDict(b=1, a=2)
    state = {
        "ints": [0, -1, 2**64, -(10**4299), 10**4300 - 1],  # up to the 4,300 digits JSON reads
        "text": ["", "é", "\u2028", "\x00", '"\\'],
        "keys": {1: "i", 2.5: "f", None: "n", False: "b", (1, "x"): "t", b"k": "bytes", torch.float16: "dtype"},
        "size": torch.Size([0, 2**40]),
        "devices": [torch.device("cpu"), torch.device("cuda:3")],
        "odict": odict,
    }
    with SyncCheckpointer(_config(tmp_path)) as ckpt:  # no pickle: all of it is plain data
        ckpt.save(state, step=10**20 - 1).wait()  # the largest step a folder name holds
        assert_same(ckpt.load(), state)


@pytest.mark.parametrize(
    ("metadata", "problem"),
    [
        ({1: "x"}, "is not a str"),
        ({"t": (1, 2)}, "a tuple"),
        ({"nan": float("nan")}, "non-finite"),
        ({"n": 10**5000}, "4300 digits"),
        ({"s": "\ud800"}, "UTF-8"),
        ({"o": object()}, "a object"),
    ],
)
def test_metadata_json_cannot_give_back_is_refused_by_save(
    tmp_path: Path, metadata: dict[Any, Any], problem: str
) -> None:
    with SyncCheckpointer(_config(tmp_path)) as ckpt:
        with pytest.raises(UnsupportedStateError, match=problem):
            ckpt.save({"w": torch.ones(1)}, step=1, metadata=metadata)
        ckpt.save({"w": torch.ones(1)}, step=1, metadata={"ok": [1, {"x": None}]}).wait()
        assert ckpt.manifest().metadata == {"ok": [1, {"x": None}]}


def test_steps_and_tensors_a_manifest_cannot_name_are_refused_by_save(tmp_path: Path) -> None:
    with SyncCheckpointer(_config(tmp_path)) as ckpt:
        with pytest.raises(StepOrderError, match="from 0 to"):
            ckpt.save({"w": torch.ones(1)}, step=10**20)
        with pytest.raises(UnsupportedStateError, match="'?many'?: a tensor of 65 dimensions"):
            ckpt.save({"many": torch.zeros([1] * 65)}, step=1)
        assert ckpt.steps() == []


@pytest.mark.parametrize("keep_last", [1, 3])
def test_an_int_json_cannot_read_never_costs_the_last_good_step(tmp_path: Path, keep_last: int) -> None:
    """It committed, every load then failed on JSON's digit limit, and retention (trusting
    the manifest this process had written) deleted the good steps in the same wait()."""
    with SyncCheckpointer(_config(tmp_path, retention={"keep_last": keep_last})) as ckpt:
        ckpt.save({"n": 1}, step=1).wait()
        for step in (2, 3, 4):
            with pytest.raises(UnsupportedStateError, match="'n' \\(an int of more than 4300 digits\\)"):
                ckpt.save({"n": 10**5000}, step=step)
        assert ckpt.steps() == [1] and ckpt.load() == {"n": 1}
    with SyncCheckpointer(_config(tmp_path, pickle_values=True, retention={"keep_last": 1})) as ckpt:
        ckpt.save({"n": 10**5000}, step=2).wait()  # pickled: it loads back
        assert ckpt.steps() == [2] and ckpt.load(allow_pickle=True) == {"n": 10**5000}


def test_a_manifest_the_reader_refuses_is_never_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last guard: what slips past save()'s checks is read back as a reader would before
    the commit, and refused there with a typed error; the previous step stays the latest."""
    monkeypatch.setattr(plan, "check_metadata", lambda metadata: None)  # save()'s own check, out of the way
    with SyncCheckpointer(_config(tmp_path, retention={"keep_last": 1})) as ckpt:
        ckpt.save({"w": torch.ones(2)}, step=1).wait()
        handle = ckpt.save({"w": torch.zeros(2)}, step=2, metadata={"n": 10**5000})
        with pytest.raises(UnsupportedStateError, match="step 2: this save's manifest would not be read back"):
            handle.wait()
        assert ckpt.steps() == [1] and torch.equal(ckpt.load()["w"], torch.ones(2))
    assert not (tmp_path / "ckpt" / step_dir(2)).exists()  # its data removed, no manifest written


def test_the_readers_digit_limit_holds_whatever_the_process_allows(tmp_path: Path) -> None:
    import sys

    document = b'{"format": "aiosnap", "format_version": 1, "step": ' + b"9" * 4400 + b"}"
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # this process would parse any int; other readers would not
    try:
        with pytest.raises(ManifestError, match="digits"):
            Manifest.from_json(document, "m")
    finally:
        sys.set_int_max_str_digits(old)


def test_a_manifest_too_large_to_read_is_refused_by_save_naming_the_paths(tmp_path: Path) -> None:
    big = "x" * (MAX_MANIFEST_BYTES + 1024**2)  # 129 MiB
    with SyncCheckpointer(_config(tmp_path)) as ckpt:
        with pytest.raises(UnsupportedStateError, match=r"about 129 MiB, more than the 128 MiB .*'notes/vocab' \(129"):
            ckpt.save({"w": torch.ones(1), "notes": {"vocab": big, "small": "y"}}, step=1)
        assert ckpt.steps() == []


def test_a_long_list_or_a_huge_table_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_size, "MAX_MANIFEST_BYTES", 1024**2)
    with SyncCheckpointer(_config(tmp_path)) as ckpt:
        with pytest.raises(UnsupportedStateError, match=r"'cfg/ids' \("):
            ckpt.save({"cfg": {"ids": list(range(300_000)), "name": "run"}}, step=1)
        with pytest.raises(UnsupportedStateError, match="the table of its 5000 tensors"):
            ckpt.save({f"t{i}": torch.ones(1) for i in range(5000)}, step=1)
        ckpt.save({"ids": list(range(1000))}, step=1).wait()  # well below: no second look


def test_the_commit_reads_back_with_the_readers_size_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aiosnap.format import manifest

    with SyncCheckpointer(_config(tmp_path)) as ckpt:
        ckpt.save({"w": torch.ones(2)}, step=1).wait()
        monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 4096)  # readers and the commit; not save()'s estimate
        handle = ckpt.save({"w": torch.ones(2), "text": "x" * 8192}, step=2)
        with pytest.raises(UnsupportedStateError, match="too large for a manifest"):
            handle.wait()
        monkeypatch.undo()
        assert ckpt.steps() == [1]
        path = tmp_path / "ckpt" / step_dir(1) / MANIFEST_FILE
        assert path.stat().st_size < 4096


def test_bit_packed_dtypes_save_and_load_through_every_copy(tmp_path: Path) -> None:
    """Found by the state fuzzer: torch views int1..uint7 tensors but has no copy kernel for
    them, so a strided one failed save() with a raw NotImplementedError, and a load into one
    failed the same way."""
    raw = torch.arange(24, dtype=torch.uint8).reshape(4, 6)
    state = {"strided": raw.view(torch.int3).t(), "flat": raw.view(torch.uint4)[1]}
    with SyncCheckpointer(_config(tmp_path)) as ckpt:
        ckpt.save(state, step=1).wait()
        loaded = ckpt.load()
        into = {"strided": torch.empty_like(state["strided"]), "flat": torch.empty_like(state["flat"])}
        ckpt.load(into)
    for name, tensor in state.items():
        for got in (loaded[name], into[name]):
            assert got.dtype == tensor.dtype and got.view(torch.uint8).equal(tensor.view(torch.uint8)), name


def test_rank_local_values_and_keys_follow_the_same_definition() -> None:
    """The rank-local part of a state is flattened apart, by the same rules, and its
    refusals are named with the rest's."""
    state = {"rng": {"seen": {1}, "python": (3, (1, 2), None)}, "loader": {Mode.TRAIN: 0}, "w": torch.ones(2)}
    with pytest.raises(UnsupportedStateError, match=r"2 value\(s\).*'rng/seen' \(a set\).*'loader/train'"):
        plan.make_plan(state, step=1, chunk_bytes=1 << 20, rank_local=["rng"])
    made = plan.make_plan(state, step=1, chunk_bytes=1 << 20, rank_local=["rng"], pickle_values=True)
    assert made.spec.distributed is not None and [e.kind for e in made.entries] == ["pickle", "tensor", "pickle"]
