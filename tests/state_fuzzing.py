"""Random states drawn from every class of value a state may hold, for the differential
fuzzer of ``save()`` (tests/test_fuzz.py): each draw says what ``save()`` must do with it.

A drawn value is *plain* (stored as data: it must load back exactly), *pickled* (only
pickle stores it: saved when the checkpointer allows pickles, else refused), or *refused*
(no format of aiosnap holds it: a tensor of 65 dims, a storage shrunk below its view, a meta
or sparse tensor, metadata JSON cannot give back, a step out of range), or *deep* (a chain of
containers around the depth bound: refused on the caller's thread as nested too deep, or
saved like any other). Deterministic for a given seed.
"""

from __future__ import annotations

import enum
import io
import math
import random
import struct
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from aiosnap.format.dtypes import DTYPE_ITEMSIZE
from aiosnap.format.manifest import Manifest
from aiosnap.format.values import MAX_TREE_DEPTH, key_text

PLAIN, PICKLED, REFUSED, DEEP = "plain", "pickled", "refused", "deep"
_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Mode(enum.StrEnum):
    TRAIN = "train"


class Level(enum.IntEnum):
    HIGH = 3


class Counter:
    """A Stateful object (saved as its state dict), hashable (a dict key: pickled)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": [self.n, float(self.n) / 3]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]

    def __eq__(self, other: object) -> bool:
        return type(other) is Counter and other.n == self.n

    def __hash__(self) -> int:
        return hash(self.n)


class Holder:
    """A user object (pickled) holding tensors of any dtype."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __eq__(self, other: object) -> bool:
        return type(other) is Holder and other.tensors.keys() == self.tensors.keys()


def _plain_dtypes() -> list[torch.dtype]:
    """Every dtype a plain tensor can have (the quantized kinds are made by quantizing, and
    refused anyway)."""
    return [getattr(torch, name) for name in DTYPE_ITEMSIZE if not name.startswith(("qint", "quint"))]


DTYPES = _plain_dtypes()

_TEXT = ["", "x", "é", "日本", "😀", "\x00", "\u2028", '"\\\n', "a/b", "#_metadata", "\ud800", "file-\udcff"]
_INTS = [0, 1, -1, 2**31, 2**63, -(2**64), 10**4300 - 1, -(10**4300 - 1), 10**4300, -(10**5000)]
_NANS = [struct.unpack("<d", struct.pack("<Q", bits))[0] for bits in (0xFFF8000000000000, 0x7FF8000000000001)]
_FLOATS = [0.0, -0.0, 1.5, 1e308, 5e-324, float("nan"), *_NANS, float("inf"), float("-inf")]


@dataclass
class Draw:
    """What a drawn state holds, and so what ``save()`` must do with it."""

    kinds: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)

    def merge(self, other: Draw) -> None:
        self.kinds |= other.kinds
        self.notes += other.notes

    def saw(self, kind: str, what: str) -> None:
        self.kinds.add(kind)
        if kind != PLAIN:
            self.notes.append(what)


class StateDrawer:
    """Draws states: ``draw()`` -> (state, metadata, step offset, :class:`Draw`)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.generator = torch.Generator().manual_seed(rng.randrange(2**31))

    def tensor(self, draw: Draw) -> torch.Tensor:
        rng = self.rng
        dtype = rng.choice(DTYPES)
        shape = rng.choice([(), (0,), (3,), (2, 3), (3, 0, 2), (2, 2, 2), (1,) * 5])
        numel = math.prod(shape)
        raw = torch.randint(0, 256, (max(2 * numel, 1) * dtype.itemsize,), dtype=torch.uint8, generator=self.generator)
        carrier = _CARRIERS.get(dtype.itemsize, dtype)  # made in a dtype torch copies, then viewed as dtype
        values = (raw & 1 if dtype is torch.bool else raw).view(carrier)  # a bool's byte is 0 or 1
        if not shape:
            tensor = values[0]
        else:
            wide = values[: 2 * numel].reshape(*shape[:-1], 2 * shape[-1])
            tensor = wide[..., ::2] if rng.random() < 0.3 else wide[..., : shape[-1]].contiguous()
            if len(shape) >= 2 and rng.random() < 0.3:
                tensor = tensor.transpose(0, 1)
        tensor = tensor.view(dtype)
        odd = rng.random()
        if odd < 0.01:
            draw.saw(REFUSED, "65 dims")
            return torch.zeros([1] * 65)
        if odd < 0.02:
            shrunk = torch.randn(64, generator=self.generator)
            shrunk.untyped_storage().resize_(rng.choice([0, 16, 252]))
            draw.saw(REFUSED, "shrunk storage")
            return shrunk
        if odd < 0.03:
            draw.saw(REFUSED, "meta tensor")
            return torch.empty(3, device="meta")
        if odd < 0.04:
            draw.saw(REFUSED, "sparse tensor")
            return torch.eye(2).to_sparse()
        if odd < 0.08:  # torch.save keeps a tensor's Python attributes, tensors among them
            tensor.note, tensor.mask = "attribute", torch.arange(3).to(torch.uint16)  # type: ignore[attr-defined]
        draw.saw(PLAIN, "tensor")
        return tensor

    def leaf(self, draw: Draw) -> Any:
        rng = self.rng
        choice = rng.choices(range(10), weights=[30, 8, 8, 6, 6, 4, 4, 8, 5, 3])[0]  # tensors the most
        if choice == 0:
            return self.tensor(draw)
        if choice == 1:
            text = rng.choice(_TEXT)
            draw.saw(PICKLED if any(0xD800 <= ord(c) < 0xE000 for c in text) else PLAIN, "str with surrogates")
            return text
        if choice == 2:
            value = rng.choice(_INTS)
            draw.saw(PICKLED if abs(value) >= 10**4300 else PLAIN, "int of 4301+ digits")
            return value
        if choice == 3:
            draw.saw(PLAIN, "float")
            return rng.choice(_FLOATS)
        if choice == 4:
            draw.saw(PLAIN, "misc")
            return rng.choice(
                [None, True, False, b"", b"\x00\xff", complex(1, -0.0), complex(float("nan"), 1), torch.bfloat16]
            )
        if choice == 5:
            size = rng.choice([torch.Size([]), torch.Size([0, 3]), torch.Size([2**40]), torch.Size([-1, 3])])
            draw.saw(PICKLED if any(d < 0 for d in size) else PLAIN, "negative Size")
            return size
        if choice == 6:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch: "'mkldnn' is no longer used as device type"
                device = torch.device(rng.choice(["cpu", "cuda:1", "meta", "mkldnn"]))
            draw.saw(PICKLED if device.type == "mkldnn" else PLAIN, "mkldnn device")
            return device
        if choice == 7:
            draw.saw(PLAIN, "stateful")
            if rng.random() < 0.3:
                torch.manual_seed(rng.randrange(1000))
                return torch.nn.Linear(2, 2)
            return Counter(rng.randrange(5))
        if choice == 8:
            value = rng.choice(
                [
                    {1, 2}, frozenset({"a"}), np.str_("np"), np.int64(7), np.float32(0.5), Mode.TRAIN, Level.HIGH,
                    io.BytesIO(b"buffer"), torch.Generator().manual_seed(5),
                ]
            )  # fmt: skip
            draw.saw(PICKLED, type(value).__name__)
            return value
        draw.saw(PICKLED, "Holder")
        exotic = [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.complex32, torch.float32]
        held = {str(d): self._exotic(d) for d in rng.sample(exotic, 2)}
        if rng.random() < 0.1:  # inside a pickled value as much as among the state's own tensors
            held["shrunk"] = shrunk = torch.arange(64.0)
            shrunk.untyped_storage().resize_(16)
            draw.saw(REFUSED, "shrunk storage in a pickled value")
        return Holder(held)

    def _exotic(self, dtype: torch.dtype) -> torch.Tensor:
        raw = torch.randint(0, 256, (8 * dtype.itemsize,), dtype=torch.uint8, generator=self.generator)
        square = raw.view(dtype).reshape(2, 4)
        view = self.rng.choice(["contiguous", "strided", "transposed", "expanded", "conj"])
        if view == "strided":
            return square[:, ::2]
        if view == "transposed":
            return square.t()
        if view == "expanded":
            return square[:1, :1].expand(3, 2)
        if view == "conj" and dtype.is_complex:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch: "ComplexHalf support is experimental"
                return square.conj()
        return square

    def key(self, draw: Draw) -> Any:
        rng = self.rng
        choice = rng.randrange(12)
        if choice < 5:
            return f"k{rng.randrange(50)}"
        if choice == 5:
            text = rng.choice(_TEXT)
            draw.saw(PICKLED if any(0xD800 <= ord(c) < 0xE000 for c in text) else PLAIN, "surrogate key")
            return text
        if choice == 6:
            key = rng.choice([0, -7, 2**70, 2.5, -0.0, *_NANS, None, False, b"k", torch.float16, (1, "t", (2.5,))])
            if rng.random() < 0.2:
                key = rng.choice([10**4300 - 1, -(10**4300), 10**5000 + 3])
                draw.saw(PICKLED if abs(key) >= 10**4300 else PLAIN, "int key of 4301+ digits")
            return key
        if choice == 7:
            draw.saw(PICKLED, "numpy.str_ key")
            return np.str_(f"n{rng.randrange(5)}")
        if choice == 8:
            draw.saw(PICKLED, "enum key")
            return rng.choice([Mode.TRAIN, Level.HIGH])
        if choice == 9:
            draw.saw(PICKLED, "Stateful key")
            return Counter(rng.randrange(100, 200))
        if choice == 10:
            draw.saw(PICKLED, "Stateful in a tuple key")
            return (1, Counter(rng.randrange(200, 300)))
        return torch.Size([rng.randrange(4), 2])

    def deep(self, draw: Draw) -> Any:
        """A chain of containers around the depth bound (each dict is 3 levels of JSON, each
        list 2): whether it fits is the planner's to say, on the caller's thread."""
        rng = self.rng
        value = self.leaf(draw)
        only = rng.choice([None, 0, 1, 2, 3])  # one kind of container all the way, or mixed
        for _ in range(rng.randrange(MAX_TREE_DEPTH // 3 - 6, MAX_TREE_DEPTH // 2 + 3)):
            kind = rng.choices(range(4), weights=[3, 1, 4, 2])[0] if only is None else only
            value = [{"k": value}, OrderedDict(o=value), [value], (value,)][kind]
        draw.saw(DEEP, "a deep chain")
        return value

    def value(self, draw: Draw, depth: int) -> Any:
        rng = self.rng
        if depth == 0 and rng.random() < 0.06:
            return self.deep(draw)
        if depth >= 3 or rng.random() < 0.5:
            return self.leaf(draw)
        kind = rng.randrange(4)
        count = rng.randrange(4)
        if kind == 0:
            mapping: dict[Any, Any] = {}
            for _ in range(count):
                drawn = Draw()
                key = self.key(drawn)
                if key not in mapping:  # a key drawn again would drop what the first one held
                    mapping[key] = self.value(drawn, depth + 1)
                    draw.merge(drawn)
            return mapping
        if kind == 1:
            ordered = OrderedDict((f"o{i}", self.value(draw, depth + 1)) for i in range(count))
            if rng.random() < 0.5:
                ordered._metadata = {"": {"version": rng.randrange(3)}}  # type: ignore[attr-defined]
            return ordered
        if kind == 2:
            return [self.value(draw, depth + 1) for _ in range(count)]
        return tuple(self.value(draw, depth + 1) for _ in range(count))

    def metadata(self, draw: Draw) -> dict[Any, Any] | None:
        rng = self.rng
        choice = rng.randrange(20)
        if choice < 18:
            return None if choice < 9 else {"epoch": rng.randrange(9), "tags": ["a", {"b": None}], "lr": 0.5}
        bad: dict[Any, Any] = rng.choice(
            [{1: "x"}, {"t": (1, 2)}, {"f": float("nan")}, {"n": 10**5000}, {"s": "\ud800"}, {"o": {1, 2}}]
        )
        draw.saw(REFUSED, "metadata JSON cannot give back")
        return bad

    def draw(self) -> tuple[dict[str, Any], dict[Any, Any] | None, int, Draw]:
        draw = Draw()
        state = {f"v{i}": self.value(draw, 0) for i in range(self.rng.randrange(1, 5))}
        metadata = self.metadata(draw)
        step = 1
        if self.rng.random() < 0.02:
            draw.saw(REFUSED, "step out of range")
            step = 10**20
        return state, metadata, step, draw


def expected(value: Any) -> Any:
    """What a load without a state gives back for ``value``: Stateful objects (not dict keys,
    which are pickled whole) as their state dicts; everything else as it is."""
    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        return expected(value.state_dict())
    if type(value) in (dict, OrderedDict):
        out = type(value)((k, expected(v)) for k, v in value.items())
        if getattr(value, "_metadata", None) is not None:
            out._metadata = expected(value._metadata)  # type: ignore[attr-defined]
        return out
    if type(value) is list:
        return [expected(v) for v in value]
    if type(value) is tuple:
        return tuple(expected(v) for v in value)
    return value


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's values as bytes, row-major, whatever its dtype (sub-byte kinds included,
    which torch cannot copy) and strides."""
    carrier = _CARRIERS.get(tensor.element_size())
    same = tensor.view(carrier) if carrier is not None else tensor
    return same.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def targets(value: Any) -> Any:
    """A state of the same structure to load ``value`` back into: tensors of its dtypes,
    shapes and strides (empty), fresh Stateful objects, dicts of the same keys; any other
    value None (a load replaces it)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if isinstance(value, Counter):
        return Counter(-1)
    if isinstance(value, torch.nn.Linear):
        return torch.nn.Linear(2, 2)
    if type(value) in (dict, OrderedDict):
        if any(k != k for k in value if type(k) is float):  # NaN equals nothing: no lookup finds
            return None  # a loaded NaN key (documented): the load replaces the dict
        return type(value)((k, targets(v)) for k, v in value.items())
    return None


def _float_bits(value: float) -> bytes:
    return struct.pack("<d", value)  # NaN's sign and payload too


def _same_key(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return _float_bits(a) == _float_bits(b)
    if type(a) is tuple:
        return len(a) == len(b) and all(_same_key(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def journal_manifest(folder: Path, state: dict[str, Any], **plan: Any) -> Manifest:
    """The manifest a crash's resume would commit from the spool journal of a save of
    ``state`` (journalled under ``folder``)."""
    import asyncio

    from aiosnap.format.journal import JournalWriter, begin_record, read_journal
    from aiosnap.trainer.plan import make_plan

    made = make_plan(state, chunk_bytes=1 << 20, **{"step": 1, **plan})
    folder.mkdir(parents=True, exist_ok=True)  # the spool's folder (each save's is made in it)
    path = folder / made.spec.save_id / "journal.jsonl"
    begin = begin_record(made.spec, storage_url="file:///r", owner_url="file:///r", keep_last=None)
    asyncio.run(JournalWriter(path).append(begin, {"kind": "captured"}))
    return read_journal(path, made.spec.save_id).manifest


def assert_exact(got: Any, want: Any, path: str = "", attributes: bool = False) -> None:
    """``got`` is ``want``, loaded back: same types, bit-exact tensors and floats (NaN's sign
    and payload too), dict key order, an OrderedDict's ``_metadata``; with ``attributes``, a
    tensor's Python attributes too (what ``torch.save`` keeps)."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{path}: {got.dtype}{got.shape} != {want.dtype}"
        if want.numel():
            assert raw_bytes(got.resolve_conj()).equal(raw_bytes(want.resolve_conj())), f"{path}: other bytes"
        if attributes:
            assert_exact(got.__dict__, want.__dict__, f"{path}.__dict__", attributes)
    elif isinstance(want, float):
        assert _float_bits(got) == _float_bits(want), f"{path}: {got!r} != {want!r}"
    elif isinstance(want, complex):
        assert (_float_bits(got.real), _float_bits(got.imag)) == (_float_bits(want.real), _float_bits(want.imag))
    elif isinstance(want, dict):
        assert len(got) == len(want) and all(_same_key(a, b) for a, b in zip(got, want, strict=True)), (
            f"{path}: keys {list(got)!r:.200} != {list(want)!r:.200}"
        )
        for (key, a), b in zip(got.items(), want.values(), strict=True):
            assert_exact(a, b, f"{path}/{key_text(key)}", attributes)
        meta = (getattr(got, "_metadata", None), getattr(want, "_metadata", None))
        assert_exact(*meta, f"{path}#_metadata", attributes)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_exact(a, b, f"{path}/{index}", attributes)
    elif isinstance(want, torch.Generator):
        assert torch.equal(got.get_state(), want.get_state()), path
    elif isinstance(want, io.BytesIO):
        assert got.getvalue() == want.getvalue(), path
    elif isinstance(want, Holder):
        assert_exact(got.tensors, want.tensors, f"{path}.tensors", attributes)
    else:
        assert got == want, f"{path}: {got!r:.80} != {want!r:.80}"
