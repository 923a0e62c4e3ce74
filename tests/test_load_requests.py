"""Loads read neighbouring ranges of an object with one request (issue 12: coalesced reads),
scattered straight into the tensors, every range's crc32c still checked on its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import Config, SyncCheckpointer
from aiosnap.errors import ChecksumMismatchError
from aiosnap.storage.local import LocalStorage
from aiosnap.storage.registry import storage_from_url
from tests.conftest import FaultyStorage, damage_entry, s3_config

MANY = 20_000


def _many_small() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    return {"layers": {f"t{i}": torch.randn(16, generator=generator) for i in range(MANY)}}


def _load_counting(config: Config, storage: Any) -> tuple[dict[str, Any], int, int]:
    counted = FaultyStorage(storage)
    with SyncCheckpointer(config, storage=counted) as ckpt:
        manifest = ckpt.manifest()
        loaded = ckpt.load()
    return loaded, counted.read_requests, len(manifest.objects)


def test_twenty_thousand_small_tensors_load_with_one_request_per_object(tmp_path: Path) -> None:
    config = Config(storage={"url": str(tmp_path)}, upload={"chunk_size": "256KiB"})
    state = _many_small()
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(state, step=1).wait()
    loaded, requests, objects = _load_counting(config, LocalStorage(tmp_path))
    assert objects >= 2
    assert requests <= objects, f"{requests} reads for {objects} objects ({MANY} tensors)"
    for name, tensor in state["layers"].items():
        assert torch.equal(loaded["layers"][name], tensor), name


def test_a_flipped_byte_in_a_coalesced_read_names_its_tensor(tmp_path: Path) -> None:
    config = Config(storage={"url": str(tmp_path)}, upload={"chunk_size": "256KiB"})
    state = _many_small()
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(state, step=1).wait()
    damage_entry(config, "layers/t12345", at=3, mask=0x40)
    with SyncCheckpointer(config) as ckpt, pytest.raises(ChecksumMismatchError, match="layers/t12345"):
        ckpt.load()


@pytest.mark.both_servers
def test_s3_loads_with_one_ranged_get_per_run(s3_endpoint: str, s3_bucket: str) -> None:
    config = s3_config(s3_endpoint, s3_bucket, prefix="many")
    config = Config(**{**config.model_dump(), "upload": {"chunk_size": "256KiB"}})
    state = {"layers": {f"t{i}": torch.full((16,), float(i)) for i in range(2_000)}}
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(state, step=1).wait()
    loaded, requests, objects = _load_counting(config, storage_from_url(config.storage.url, config))
    assert requests <= objects, f"{requests} GETs for {objects} objects"
    assert all(torch.equal(loaded["layers"][k], v) for k, v in state["layers"].items())
