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
from aiosnap.errors import (
    ManifestError,
    PickleNotAllowedError,
    StateMismatchError,
    StepOrderError,
    UnsupportedStateError,
)
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


def _nested(kind: str, levels: int, leaf: Any) -> Any:
    value = leaf
    for _ in range(levels):
        if kind == "dict":
            value = {"k": value}
        elif kind == "odict":
            value = OrderedDict(k=value)
        elif kind == "list":
            value = [value]
        else:
            value = (value,)
    return value


def _json_depth(doc: Any) -> int:
    """Nesting of JSON arrays and objects in ``doc``."""
    depth, pending = 0, [(doc, 0)]
    while pending:
        value, level = pending.pop()
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list):
            depth = max(depth, level + 1)
            pending += [(v, level + 1) for v in value]
    return depth


def _journal_manifest(tmp_path: Path, made: Any) -> Manifest:
    """The manifest a crash's resume would commit from the journal of ``made`` (a plan)."""
    import asyncio

    from aiosnap.format.journal import JournalWriter, begin_record, read_journal

    path = tmp_path / made.spec.save_id / "journal.jsonl"
    begin = begin_record(made.spec, storage_url="file:///r", owner_url="file:///r", keep_last=None)
    asyncio.run(JournalWriter(path).append(begin, {"kind": "captured"}))
    return read_journal(path, made.spec.save_id).manifest


def test_one_depth_bound_for_the_planner_the_commit_and_the_journal(tmp_path: Path) -> None:
    """save() counted containers (100) while each dict is three levels of JSON: dicts 84 to
    98 deep were accepted and failed in the background (pydantic's serializer stops at 254
    levels), and dicts 66 deep (lists 98) committed but their spool journal was refused on
    resume (pydantic's JSON parser stops at 200): a crash after capture lost them."""
    from aiosnap.format.values import MAX_TREE_DEPTH

    levels = {"dict": 3, "odict": 3, "list": 2, "tuple": 2}
    with SyncCheckpointer(_config(tmp_path)) as ckpt:
        for step, (kind, per) in enumerate(levels.items(), start=1):
            leaf = torch.arange(3.0)  # a tensor's node: one level
            deepest = (MAX_TREE_DEPTH - 3 - 1) // per  # below the state's own dict
            state = {"x": _nested(kind, deepest, leaf), "w": torch.ones(2)}
            with pytest.raises(UnsupportedStateError, match=f"nested deeper than {MAX_TREE_DEPTH} levels of JSON"):
                ckpt.save({"x": _nested(kind, deepest + 1, leaf)}, step=step)
            ckpt.save(state, step=step).wait()
            assert_same(ckpt.load(), state)
            manifest = ckpt.manifest()
            assert MAX_TREE_DEPTH - per < _json_depth(manifest.tree) <= MAX_TREE_DEPTH, kind
            for rank_local in ((), ["x"]):  # the tree, or a rank-local value (in its own record)
                made = plan.make_plan(state, step=step, chunk_bytes=1 << 20, rank_local=rank_local)
                assert _json_depth(_journal_manifest(tmp_path, made).model_dump()) > MAX_TREE_DEPTH - per
    exact = {"x": _nested("list", (MAX_TREE_DEPTH - 4) // 2, torch.ones(1))}  # 3 + 2 * 98 + 1: the bound itself
    assert _json_depth(plan.make_plan(exact, step=1, chunk_bytes=1 << 20).spec.tree) == MAX_TREE_DEPTH


def test_ints_are_written_and_read_whatever_digits_the_process_allows(tmp_path: Path) -> None:
    """``json_int`` called ``int(text)``, which applies ``sys.set_int_max_str_digits``: in a
    process allowing 1,000 digits a reader refused a 2,000-digit int that every other reader
    takes, a save of one failed in the background, and the spool journal's ``json.dumps``
    raised a raw ValueError out of save()."""
    import sys

    big = 10**2000 + 7
    state = {"n": big, "keys": {big: "int key"}, "w": torch.ones(2)}
    with SyncCheckpointer(_config(tmp_path)) as ckpt:  # written by a process of the default limit
        ckpt.save(state, step=1, metadata={"m": -big}).wait()
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(1000)
    try:
        spool = {"dir": str(tmp_path / "spool"), "mode": "always"}
        with SyncCheckpointer(_config(tmp_path, spool=spool)) as ckpt:
            first, first_metadata = ckpt.load(), ckpt.manifest().metadata
            ckpt.save(state, step=2, metadata={"m": big}).wait()  # journalled, committed, read back
            second, second_metadata = ckpt.load(), ckpt.manifest().metadata
        journalled = _journal_manifest(tmp_path, plan.make_plan(state, step=3, chunk_bytes=1 << 20))
    finally:
        sys.set_int_max_str_digits(old)
    assert first_metadata == {"m": -big} and second_metadata == {"m": big}
    assert_same(first, state)
    assert_same(second, state)
    assert journalled.tree["items"][0] == ["n", big]


def test_a_key_of_any_int_is_named_or_stored(tmp_path: Path) -> None:
    """A dict key int of more than 4,300 digits: the planner formatted its path before it
    classified the key, and save() raised a raw ValueError (so did a load, naming paths)."""
    huge = 10**4300
    state = {"d": {huge: torch.ones(2), "k": 1}, huge + 1: 2}
    with (
        SyncCheckpointer(_config(tmp_path)) as ckpt,
        pytest.raises(UnsupportedStateError, match=r"2 value.*'d/<an int of 14285 bits>' \(an int of more than 4300"),
    ):
        ckpt.save(state, step=1)
    with SyncCheckpointer(_config(tmp_path, pickle_values=True)) as ckpt:
        ckpt.save(state, step=1).wait()
        assert_same(ckpt.load(allow_pickle=True), state)
        into = {"d": {huge: torch.zeros(2), "k": 0}, huge + 1: 0}
        ckpt.load(into, allow_pickle=True)
        assert_same(into, state)


def test_dict_keys_and_metadata_weigh_in_the_manifests_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The size check weighed a dict's values but not its keys, nor an OrderedDict's
    ``_metadata``: 200 keys of 700 KB, or a 135 MiB string in a module's ``_metadata``, were
    accepted and refused by the commit's read-back in the background."""
    monkeypatch.setattr(manifest_size, "MAX_MANIFEST_BYTES", 1024**2)
    long_keys = {f"{i:04d}" + "k" * 8000: i for i in range(200)}  # 1.6 MB of keys, 200 small values
    odict: OrderedDict[str, Any] = OrderedDict(w=torch.ones(2))
    odict._metadata = {"": {"note": "n" * 1_200_000}}  # type: ignore[attr-defined]
    with SyncCheckpointer(_config(tmp_path)) as ckpt:
        with pytest.raises(UnsupportedStateError, match=r"most of it is in 'vocab' \(1\.5 MiB\)"):
            ckpt.save({"vocab": long_keys}, step=1)
        with pytest.raises(UnsupportedStateError, match=r"'model#_metadata//note' \(1\.1 MiB\)"):
            ckpt.save({"model": odict}, step=1)
        assert ckpt.steps() == []


def test_nan_keeps_its_sign_and_payload(tmp_path: Path) -> None:
    """Non-finite floats were stored as ``repr``: every NaN came back as ``float("nan")``."""
    import struct

    def bits(value: float) -> bytes:
        return struct.pack("<d", value)

    nans = [
        struct.unpack("<d", struct.pack("<Q", b))[0]
        for b in (0xFFF8000000000000, 0x7FF8000000000001, 0x7FF0000000000001)
    ]
    state = {"nans": nans, "c": complex(nans[0], nans[1]), "keys": {nans[2]: 1}, "plain": float("nan")}
    with SyncCheckpointer(_config(tmp_path)) as ckpt:
        ckpt.save(state, step=1).wait()
        back = ckpt.load()
    assert [bits(v) for v in back["nans"]] == [bits(v) for v in nans]
    assert (bits(back["c"].real), bits(back["c"].imag)) == (bits(nans[0]), bits(nans[1]))
    assert bits(next(iter(back["keys"]))) == bits(nans[2]) and bits(back["plain"]) == bits(float("nan"))


class _Holds:
    """A user object (pickled) holding one tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


@pytest.mark.parametrize("single", [False, True], ids=["folder", "single-file"])
def test_a_pickled_value_holds_every_kind_of_view_and_no_heap_bytes(tmp_path: Path, single: bool) -> None:
    """Inside a pickled value, a tensor whose storage was shrunk below its view was pickled
    with the heap bytes past its end (the storage check ran on the state's own tensors
    only); and a strided, expanded or conjugate view of a dtype without a legacy storage
    (uint16, uint32, complex32) was refused, where ``torch.save`` keeps it."""
    from aiosnap.interop.singlefile import ArchiveStorage

    shrunk = torch.arange(2048.0)
    shrunk.untyped_storage().resize_(64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "ComplexHalf support is experimental"
        views = {
            "u16_strided": torch.arange(16).to(torch.uint16)[::2],
            "u32_expanded": torch.tensor([7]).to(torch.uint32).expand(4),
            "u64_transposed": torch.arange(6).to(torch.uint64).reshape(2, 3).t(),
            "c32_conj": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).to(torch.complex32).conj(),
            "f8_strided": torch.arange(9.0).to(torch.float8_e4m3fn)[::3],
        }
    with SyncCheckpointer(_config(tmp_path, pickle_values=True)) as owner:
        path = tmp_path / "single.pt"
        ckpt = owner.at(str(path), keep_last=1, storage=ArchiveStorage(path)) if single else owner
        with pytest.raises(UnsupportedStateError, match="'?held'?: _Holds cannot be saved: .*storage of 64 bytes"):
            ckpt.save({"w": torch.ones(2), "held": _Holds(shrunk)}, step=1)
        assert ckpt.steps() == []
        state = {name: _Holds(view) for name, view in views.items()}
        ckpt.save(state, step=1).wait()
        loaded = ckpt.load(allow_pickle=True)
        file = torch.load(path, weights_only=False) if single else None
    for name, view in views.items():
        want = view.resolve_conj()
        for got in (loaded[name].tensor, *((file[name].tensor,) if file else ())):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert got.view(torch.uint8).equal(want.contiguous().view(torch.uint8)), name


def test_a_partial_load_beside_pickled_keys_needs_no_allow_pickle(tmp_path: Path) -> None:
    """``load({"opt": {"a": t}})`` decoded every key of ``opt`` to find ``"a"``: pickled keys
    beside it (an Enum member, a frozenset, a tensor) made it read everything and ask for
    ``allow_pickle``, though a pickled part elsewhere needs no opt-in."""
    frozen, tensor_key = frozenset({1}), torch.tensor([4])
    state = {"opt": {"a": torch.arange(3.0), Mode.TRAIN: 5, frozen: torch.zeros(1), tensor_key: 6}, "other": {1, 2}}
    with SyncCheckpointer(_config(tmp_path, pickle_values=True)) as ckpt:
        ckpt.save(state, step=1).wait()
        into = {"opt": {"a": torch.empty(3)}}
        ckpt.load(into)
        assert torch.equal(into["opt"]["a"], state["opt"]["a"])
        for wanted in ({"opt": {Mode.TRAIN: 0}}, {"opt": {"a": torch.empty(3), frozen: None}}):
            with pytest.raises(PickleNotAllowedError):  # a key that is pickled: its opt-in
                ckpt.load(wanted)
            ckpt.load(wanted, allow_pickle=True)
        assert wanted["opt"][frozen].equal(torch.zeros(1)) and torch.equal(wanted["opt"]["a"], state["opt"]["a"])
        with pytest.raises(StateMismatchError, match=r"\['b'\] are not in checkpoint"):
            ckpt.load({"opt": {"b": 0}}, allow_pickle=True)


def test_what_a_folder_does_not_keep_is_documented_and_so(tmp_path: Path) -> None:
    """docs/concepts/what-a-state-may-hold.md: a folder keeps a tensor's values, not its
    ``requires_grad`` or Python attributes, and an OrderedDict's ``_metadata`` but no other
    attribute; a NaN key loads back with load(), and load(state) reports it missing."""
    ordered: OrderedDict[str, Any] = OrderedDict(w=torch.ones(2))
    ordered._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    ordered.note = "dropped"  # type: ignore[attr-defined]
    tagged = torch.arange(3.0)
    tagged.note = "dropped"  # type: ignore[attr-defined]
    nan = float("nan")
    state = {"o": ordered, "t": tagged, "g": torch.ones(2, requires_grad=True), "d": {nan: 1}}
    with SyncCheckpointer(_config(tmp_path)) as ckpt:
        ckpt.save(state, step=1).wait()
        back = ckpt.load()
        with pytest.raises(StateMismatchError, match=r"d: key\(s\) \[nan\] are not in checkpoint"):
            ckpt.load({"d": {nan: 0}})
    assert back["o"]._metadata == {"": {"version": 1}} and not hasattr(back["o"], "note")
    assert not hasattr(back["t"], "note") and not back["g"].requires_grad and torch.equal(back["g"], state["g"])
    assert list(back["d"].values()) == [1] and next(iter(back["d"])) != next(iter(back["d"]))
