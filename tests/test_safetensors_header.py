"""Safetensors headers: what aiosnap builds, the safetensors library reads; what the library
writes, aiosnap parses; hostile headers are a CorruptCheckpointError naming the file, found
before anything is allocated beyond the file's size; mutated real headers (thousands of
cases) never get past the checks unless they describe the data exactly."""

from __future__ import annotations

import asyncio
import json
import random
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch
from aiosnap import CorruptCheckpointError, SyncCheckpointer
from aiosnap.format.manifest import Manifest, signed_json
from aiosnap.interop.safetensors.header import CODE_OF_AIOSNAP, build_header, parse_header
from aiosnap.interop.safetensors.reader import SafetensorsFolder, translate
from aiosnap.storage.local import LocalStorage
from safetensors.torch import load, save
from tests.conftest import FaultyStorage
from tests.fuzzing import mutate_bytes, mutate_document

ALL_DTYPES = [getattr(torch, name) for name in CODE_OF_AIOSNAP]


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    found = {
        f"t.{dtype}": (torch.randn(3, 5, generator=generator) * 4).to(dtype)
        for dtype in ALL_DTYPES
        if dtype != torch.bool
    }
    found["mask"] = torch.rand(7, generator=generator) > 0.5
    found["scalar"] = torch.tensor(2.5)
    found["empty"] = torch.zeros(0, 4)
    return found


def test_what_the_library_writes_parses_and_what_aiosnap_builds_the_library_reads() -> None:
    tensors = _tensors()
    data = save(tensors, metadata={"format": "pt", "note": "é"})
    parsed = parse_header(data, len(data), "lib.safetensors")
    assert parsed.metadata == {"format": "pt", "note": "é"}
    assert {t.name for t in parsed.tensors} == set(tensors)
    for t in parsed.tensors:
        assert t.shape == tuple(tensors[t.name].shape)
        assert t.aiosnap_dtype == str(tensors[t.name].dtype).removeprefix("torch.")
    order = sorted(parsed.tensors, key=lambda t: t.name)  # another order than the library's
    header = build_header([(t.name, t.dtype, t.shape) for t in order], {"format": "pt"})
    assert len(header) % 8 == 0
    body = b"".join(data[parsed.data_start + t.begin : parsed.data_start + t.end] for t in order)
    back = load(header + body)
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(back[name], tensor), name
    again = parse_header(header + body, len(header + body), "built.safetensors")
    assert [t.name for t in again.tensors] == [t.name for t in order]


def _file(tensors: dict[str, Any], data_size: int, *, metadata: Any = None, raw: bytes | None = None) -> bytes:
    document: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    document.update(tensors)
    body = raw if raw is not None else json.dumps(document).encode()
    return struct.pack("<Q", len(body)) + body + bytes(data_size)


def _f32(shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


HOSTILE: dict[str, bytes] = {
    "too short": b"\x01\x02",
    "length past the end": struct.pack("<Q", 10**6) + b"{}",
    "length of 2**63": struct.pack("<Q", 2**63) + b"{}" + bytes(64),
    "zero length": struct.pack("<Q", 0) + bytes(16),
    "bad json": _file({}, 0, raw=b'{"a": [1, 2'),
    "not utf-8": _file({}, 0, raw=b'{"\xff\xfe": 1}'),
    "not an object": _file({}, 0, raw=b"[1, 2, 3]"),
    "leading space": _file({}, 0, raw=b' {"a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}') + bytes(4),
    "duplicate key": _file({}, 8, raw=b'{"a": %s, "a": %s}' % ((json.dumps(_f32([2], 0, 8)).encode(),) * 2)),
    "deep nesting": _file({}, 0, raw=b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "offsets out of range": _file({"a": _f32([4], 0, 16)}, 8),
    "offsets reversed": _file({"a": _f32([0], 8, 0)}, 8),
    "overlapping tensors": _file({"a": _f32([2], 0, 8), "b": _f32([2], 4, 12)}, 12),
    "a hole": _file({"a": _f32([1], 0, 4), "b": _f32([1], 8, 12)}, 12),
    "trailing bytes": _file({"a": _f32([1], 0, 4)}, 8),
    "huge shape": _file({"a": _f32([2**40, 2**40, 2**40], 0, 8)}, 8),
    "negative dimension": _file({"a": _f32([-2], 0, 8)}, 8),
    "boolean dimension": _file({"a": _f32([True], 0, 4)}, 4),
    "float offset": _file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4]}}, 4),
    "size mismatch": _file({"a": _f32([3], 0, 8)}, 8),
    "too many dimensions": _file({"a": _f32([1] * 65, 0, 4)}, 4),
    "unknown dtype": _file({"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, 16),
    "extra field": _file({"a": {**_f32([1], 0, 4), "x": 1}}, 4),
    "metadata not strings": _file({"a": _f32([1], 0, 4)}, 4, metadata={"k": 1}),
    "metadata not an object": _file({"a": _f32([1], 0, 4)}, 4, metadata=["k"]),
    "empty name": _file({"": _f32([1], 0, 4)}, 4),
    # a dimension of 0 once let any later one through (the product stayed 0): each is bounded now
    "zero then a dimension past 2**64": _file({"a": _f32([0, 2**64 + 1], 0, 0)}, 0),
    "strides past 2**63": _file({"a": _f32([0, 2**62, 2**62], 0, 0)}, 0),
    "lone surrogate name": _file({}, 1, raw=b'{"\\ud800": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}'),
    "lone surrogate in metadata": _file(
        {"a": _f32([1], 0, 4)},
        4,
        raw=b'{"__metadata__": {"k": "\\udfff"}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
    ),
    "metadata of lists": _file({}, 0, raw=b'{"__metadata__": {"k": [' + b"[]," * 1000 + b"[]]}}"),
    "metadata twice": _file({}, 0, raw=b'{"__metadata__": {}, "__metadata__": {}}'),
    "a tensor description of megabytes": _file(
        {}, 0, raw=b'{"a": {"dtype": "U8", "shape": [' + b"1," * 10**6 + b"1]}}"
    ),
    "text after the object": _file(
        {"a": _f32([1], 0, 4)}, 4, raw=b'{"a": ' + json.dumps(_f32([1], 0, 4)).encode() + b"} {}"
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_header_is_a_clear_error_naming_the_file(case: str) -> None:
    data = HOSTILE[case]
    with pytest.raises(CorruptCheckpointError, match="evil.safetensors"):
        parse_header(data, len(data), "evil.safetensors")


def test_hostile_headers_fail_the_whole_load_path_with_a_typed_error(tmp_path: Path) -> None:
    """Through open_safetensors' reader and a load, not only parse_header: what once passed
    the parser and then failed deeper as a pydantic ValidationError or a UnicodeEncodeError."""
    for number, case in enumerate(["zero then a dimension past 2**64", "strides past 2**63", "lone surrogate name",
                                   "lone surrogate in metadata"]):  # fmt: skip
        folder = tmp_path / str(number)
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(HOSTILE[case])
        with (
            SyncCheckpointer({"ram_budget": "1MiB"}, storage=SafetensorsFolder(LocalStorage(folder))) as ckpt,
            pytest.raises(CorruptCheckpointError, match=r"model\.safetensors"),
        ):
            ckpt.load()


def _peak_allocation(work: Any) -> int:
    """Bytes allocated at the peak while ``work()`` runs (what tracemalloc sees: Python
    objects, bytes and bytearrays, in any thread)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        work()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_what_a_header_costs_is_bounded_by_its_size(tmp_path: Path) -> None:
    """A header of nested empty lists (``json.loads`` made ~20 bytes of objects of each
    byte) is refused at its first wrong byte; a valid header of 5,000 zero-size tensors
    (the most objects a header can describe per byte) costs a bounded multiple of its size
    to translate, and a load takes the translated manifest as it is (not parsed again)."""
    nested = b'{"__metadata__":{"k":[' + b"[]," * 100_000 + b"[]]}}"  # 300 KB
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / "model.safetensors").write_bytes(struct.pack("<Q", len(nested)) + nested)
    folder = SafetensorsFolder(LocalStorage(tmp_path / "nested"))

    def refused() -> None:
        with pytest.raises(CorruptCheckpointError, match="strings to strings"):
            asyncio.run(folder.manifest())

    assert _peak_allocation(refused) < 3 * len(nested)

    many = {f"layers.{i}.bias": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(5000)}
    body = json.dumps(many, separators=(",", ":")).encode()
    (tmp_path / "many").mkdir()
    (tmp_path / "many" / "model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body)
    folder = SafetensorsFolder(LocalStorage(tmp_path / "many"))
    peak = _peak_allocation(lambda: asyncio.run(folder.manifest()))
    assert peak < 40 * len(body), (peak, len(body))  # was 125x: a pydantic validation of every entry
    with SyncCheckpointer({"ram_budget": "1MiB"}, storage=folder) as ckpt:
        assert ckpt.manifest() is asyncio.run(folder.manifest())


def test_a_hostile_folder_fails_to_load_reading_no_more_than_it_holds(tmp_path: Path) -> None:
    """Through the whole load path: the header length is checked against the file's size
    before the header is read, so a hostile length reads (and allocates) nothing more."""
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 90_000_000) + b"{}" + bytes(100))
    inner = FaultyStorage(LocalStorage(tmp_path))
    with (
        SyncCheckpointer({"ram_budget": "1MiB"}, storage=SafetensorsFolder(inner)) as ckpt,
        pytest.raises(CorruptCheckpointError, match=r"model\.safetensors.*runs past the end"),
    ):
        ckpt.load()
    assert 0 < inner.read_bytes <= 110


def test_a_valid_but_odd_header_loads(tmp_path: Path) -> None:
    """Trailing spaces after the JSON, zero-size tensors, a 0-d tensor, names with dots
    and unicode: all fine, and loaded bit-exact."""
    tensors = {"é.x": torch.arange(6, dtype=torch.int32).reshape(2, 3), "z": torch.zeros(0), "s": torch.tensor(7.0)}
    data = bytearray(save(tensors))
    (length,) = struct.unpack_from("<Q", data)
    padded = struct.pack("<Q", length + 16) + bytes(data[8 : 8 + length]) + b" " * 16 + bytes(data[8 + length :])
    (tmp_path / "model.safetensors").write_bytes(padded)
    with SyncCheckpointer({"ram_budget": "1MiB"}, storage=SafetensorsFolder(LocalStorage(tmp_path))) as ckpt:
        state = ckpt.load()
    assert set(state["model"]) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(state["model"][name], tensor)


HEADER_VALUES = [2**64 + 1, 2**63 - 1, [0, 2**64 + 1], [0, 2**62, 2**62], [2**31] * 3, "\ud800", "F32", "BF16"]
"""Values worth trying in a header beside the shared ones (huge and zero dimensions, lone surrogates)."""
HEADER_NAMES = ["\ud800", "a\udfffb", "", "__metadata__", "é", "x" * 300, "w"]


def _library_accepts(data: bytes) -> bool:
    try:
        safetensors.deserialize(data)
    except Exception:
        return False
    return True


def test_mutated_headers_are_refused_or_describe_the_data_exactly(request: pytest.FixtureRequest) -> None:
    """Damage and forgery of a real file's header bytes and JSON: parse_header either raises
    CorruptCheckpointError or returns tensors that tile the data section exactly with sizes
    that match their dtype and shape; and it never accepts what the library refuses."""
    cases = int(request.config.getoption("--fuzz-cases"))
    base = save(
        {"w": torch.randn(4, 3), "b": torch.arange(5, dtype=torch.int16), "e": torch.zeros(0)}, {"format": "pt"}
    )
    (length,) = struct.unpack_from("<Q", base)
    document = json.loads(base[8 : 8 + length])
    data_section = base[8 + length :]
    rng = random.Random(23)
    accepted = 0
    named: list[bool] = []
    for case in range(cases):
        if case % 2:
            mutated = mutate_document(document, rng, HEADER_VALUES)
            if isinstance(mutated, dict) and mutated and rng.random() < 0.2:  # a tensor renamed
                name = rng.choice(list(mutated))
                mutated[rng.choice(HEADER_NAMES)] = mutated.pop(name)
            body = json.dumps(mutated).encode()
            data = struct.pack("<Q", len(body)) + body + data_section
        else:
            data = mutate_bytes(base, rng)
        try:
            parsed = parse_header(data, len(data), "fuzz.safetensors")
        except CorruptCheckpointError as exc:
            named.append("fuzz.safetensors" in str(exc))
            continue
        accepted += 1
        position = 0
        for t in parsed.tensors:
            assert t.begin == position
            position = t.end
        assert parsed.data_start + position == len(data)
        assert _library_accepts(data), f"case {case}: aiosnap accepts a header the library refuses"
        # what is accepted translates into a manifest the reader's own validator accepts
        translated = translate({"model.safetensors": (len(data), parsed)}, "model/", "fuzz")
        doc = json.loads(signed_json(translated))
        doc.pop("crc32c"), doc.pop("foreign")
        Manifest.translated(doc, "safetensors", "fuzz")
    assert accepted > 0  # the unmutated parts of the space were reached too
    assert named and all(named)  # every refusal names the file


def test_reading_a_header_is_bounded_by_the_file_not_by_the_header(tmp_path: Path) -> None:
    """A header whose length field is larger than the first read asks for the rest once,
    and a folder of many such files reads each header once."""
    names = {f"layer.{i}.w": torch.full((2,), float(i)) for i in range(3000)}  # a ~200 KB header
    (tmp_path / "model.safetensors").write_bytes(save(names))
    inner = FaultyStorage(LocalStorage(tmp_path))
    folder = SafetensorsFolder(inner)
    manifest = asyncio.run(folder.manifest())
    assert len(manifest.entries) == 3000
    assert inner.read_requests <= 2
