"""Bit-exact round trips of every kind of value the state may hold."""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from aiosnap import Config, StateMismatchError, SyncCheckpointer
from tests.conftest import assert_same

pytestmark = pytest.mark.both_executors


def _all_cpu_dtypes() -> list[torch.dtype]:
    names = [
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "complex128",
        "complex64",
        "complex32",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    ]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (NaN payloads included)."""
    g = torch.Generator().manual_seed(seed)
    itemsize = dtype.itemsize
    numel = math.prod(shape)
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", _all_cpu_dtypes(), ids=str)
def test_every_dtype_round_trips_bit_exact(small_config: Config, dtype: torch.dtype) -> None:
    state = {
        "odd": _random_bits((3,), dtype, 1),
        "matrix": _random_bits((33, 17), dtype, 2),
        "scalar": _random_bits((), dtype, 3),
        "empty": torch.empty((0, 5), dtype=dtype),
        "big": _random_bits((70_001,), dtype, 4),  # several 64 KiB chunks for any itemsize
    }
    with SyncCheckpointer(small_config) as ckpt:
        ckpt.save(state, step=1).wait()
        restored = ckpt.load()
    assert_same(restored, state)


def test_views_strides_and_shared_storage(small_config: Config) -> None:
    base = torch.randn(40, 30, 20)
    state = {
        "transposed": base.transpose(0, 2),
        "sliced": base[3:37:3, ::2, 5:],
        "permuted_big": torch.randn(64, 300, 9).permute(2, 0, 1),  # non-contiguous, > chunk
        "expanded": torch.randn(1, 7).expand(500, 7),
        "row": base[5],
        "col": base[:, 4, 7],
        "alias_a": base,
        "alias_b": base,
    }
    with SyncCheckpointer(small_config) as ckpt:
        ckpt.save(state, step=1).wait()
        restored = ckpt.load()
        manifest = ckpt.manifest()
    for key, value in state.items():
        assert torch.equal(restored[key], value.contiguous()), key
    assert restored["alias_a"] is restored["alias_b"], "the same view saved twice comes back as one tensor"
    assert sum(1 for e in manifest.entries if e.path.startswith("alias")) == 1
    record = next(e for e in manifest.entries if e.path == "transposed")
    assert record.stride == list(base.transpose(0, 2).stride())


def test_huge_tensor_is_split_across_objects(root: Path) -> None:
    config = Config(storage={"url": str(root)}, ram_budget="4MiB", upload={"chunk_size": "1MiB"})
    big = torch.randn(5_000_000)  # 20 MB, 5x the whole budget
    with SyncCheckpointer(config) as ckpt:
        result = ckpt.save({"big": big}, step=1).wait()
        assert torch.equal(ckpt.load()["big"], big)
        manifest = ckpt.manifest()
    assert result.objects == manifest.total_bytes // (1024 * 1024) + 1 == len(manifest.objects) == 20
    assert all(o.nbytes <= 1024 * 1024 for o in manifest.objects)
    assert result.ram_high_water <= 4 * 1024 * 1024


def test_nested_containers_and_plain_values(small_config: Config) -> None:
    od: OrderedDict[str, object] = OrderedDict([("z", 1), ("a", 2)])
    state = {
        "nested": {"list": [1, [2, (3, 4.5)], {"t": torch.arange(5)}], "tuple": (None, "s", True, False)},
        "numbers": {"int": 2**70, "neg": -3, "float": 0.1, "nan": float("nan"), "inf": float("-inf"), "c": 1 + 2j},
        "misc": {
            "bytes": b"\x00\xffbin",
            "dtype": torch.bfloat16,
            "device": torch.device("cpu"),
            "size": torch.Size([2, 3]),
            7: "int key",
            (1, 2): "tuple key",
        },
        "ordered": od,
        "empty": {"d": {}, "l": [], "t": ()},
    }
    with SyncCheckpointer(small_config) as ckpt:
        ckpt.save(state, step=5).wait()
        restored = ckpt.load(step=5)
    assert_same(restored, state)
    assert list(restored["ordered"]) == ["z", "a"]


def test_module_state_dict_metadata_survives(small_config: Config) -> None:
    bn = torch.nn.BatchNorm1d(4)
    bn(torch.randn(8, 4))
    with SyncCheckpointer(small_config) as ckpt:
        ckpt.save({"bn": bn}, step=1).wait()
        restored = ckpt.load()["bn"]
    assert restored._metadata == bn.state_dict()._metadata
    fresh = torch.nn.BatchNorm1d(4)
    fresh.load_state_dict(restored)
    assert torch.equal(fresh.running_mean, bn.running_mean)
    assert int(fresh.num_batches_tracked) == 1


def test_load_in_place_into_existing_objects(small_config: Config) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    buffer = torch.randn(4)
    state = {"model": model, "plain": {"buf": buffer, "epoch": 3}}
    with SyncCheckpointer(small_config) as ckpt:
        ckpt.save(state, step=1).wait()
        other = torch.nn.Linear(8, 8)
        target_buf = torch.zeros(4)
        target = {"model": other, "plain": {"buf": target_buf, "epoch": 0}}
        assert ckpt.load(target) is target
    assert torch.equal(other.weight, model.weight)
    assert target["plain"]["buf"] is target_buf and torch.equal(target_buf, buffer)
    assert target["plain"]["epoch"] == 3


def test_load_in_place_rejects_missing_keys_and_bad_shapes(small_config: Config) -> None:
    with SyncCheckpointer(small_config) as ckpt:
        ckpt.save({"a": torch.zeros(3)}, step=1).wait()
        with pytest.raises(StateMismatchError, match="'b'"):
            ckpt.load({"b": torch.zeros(3)})
        with pytest.raises(ValueError, match="shape"):
            ckpt.load({"a": torch.zeros(4)})
