"""Issue 14, item 5: a plugin checkpoint is one file every Lightning tool reads -- plain
``torch.load``, ``load_from_checkpoint``, a Trainer without the plugin, the loggers'
``_scan_checkpoints``, ``os.path.isfile``/``getsize`` -- while the plugin itself loads it
verified (aiosnap's crc32c per tensor)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl
from aiosnap import Config
from aiosnap.errors import ChecksumMismatchError
from aiosnap.integrations.lightning import AiosnapCheckpointIO
from aiosnap.interop.singlefile import is_archive
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers.utilities import _scan_checkpoints
from tests.test_lightning import QUIET_LIGHTNING, Regressor, loader, stop_and_resume, trainer

pytestmark = [pytest.mark.both_executors, QUIET_LIGHTNING]


@pytest.fixture
def config() -> Config:
    return Config(ram_budget="16MiB", upload={"chunk_size": "64KiB"})


def _fit_and_keep(tmp_path: Path, config: Config, epochs: int = 2) -> tuple[ModelCheckpoint, Regressor]:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="train_loss", save_top_k=2, save_last=True)
    model = Regressor(width=48)
    fit = trainer(epochs, AiosnapCheckpointIO(config), [checkpoints], tmp_path)
    fit.fit(model, loader())
    return checkpoints, model


def test_plain_torch_load_reads_a_plugin_checkpoint(tmp_path: Path, config: Config) -> None:
    checkpoints, model = _fit_and_keep(tmp_path, config)
    last = Path(checkpoints.last_model_path)
    assert last.is_file() and os.path.getsize(last) > 0 and is_archive(last)
    plain = torch.load(last, weights_only=False)  # an inference script, no aiosnap involved
    verified = AiosnapCheckpointIO(config, allow_pickle=True).load_checkpoint(last)
    assert plain["global_step"] == verified["global_step"] == 8 and plain["epoch"] == 1
    assert plain["state_dict"].keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(plain["state_dict"][name], tensor), name
        assert torch.equal(verified["state_dict"][name], tensor), name
    plain_adam = plain["optimizer_states"][0]["state"]
    for index, moments in verified["optimizer_states"][0]["state"].items():
        for key, value in moments.items():
            assert torch.equal(plain_adam[index][key], value), (index, key)
    assert plain["hyper_parameters"] == {"width": 48}
    assert plain["loops"] == verified["loops"] and plain["callbacks"].keys() == verified["callbacks"].keys()


def test_weights_only_torch_load_reads_a_state_dict_checkpoint(tmp_path: Path, config: Config) -> None:
    plugin = AiosnapCheckpointIO(config)
    state = {
        "state_dict": {
            "w": torch.randn(300, 70),
            "half": torch.randn(9, dtype=torch.bfloat16),
            "u16": torch.ones(5).to(torch.uint16),
        },
        "empty": torch.empty(0, 4),
        "strided": torch.randn(6, 5).t(),
        "epoch": 3,
        "lr": [0.1, 0.01],
        "params": [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.empty(0))],  # an empty bias
    }
    state["tied"] = state["state_dict"]["w"]
    path = tmp_path / "weights.ckpt"
    plugin.save_checkpoint(state, path)
    plugin.teardown()
    loaded = torch.load(path)  # weights_only=True: only what torch.save of the same dict needs
    for key in ("w", "half", "u16"):
        assert (
            torch.equal(loaded["state_dict"][key], state["state_dict"][key])
            and loaded["state_dict"][key].dtype == state["state_dict"][key].dtype
        )
    assert loaded["empty"].shape == (0, 4) and torch.equal(loaded["strided"], state["strided"])
    assert loaded["tied"].data_ptr() == loaded["state_dict"]["w"].data_ptr()  # shared, as with torch.save
    assert loaded["epoch"] == 3 and loaded["lr"] == [0.1, 0.01]
    assert all(type(p) is torch.nn.Parameter for p in loaded["params"]) and loaded["params"][1].shape == (0,)
    assert torch.equal(loaded["params"][0], state["params"][0])
    mapped = torch.load(path, mmap=True)  # records are aligned the way mmap loading needs
    assert torch.equal(mapped["state_dict"]["w"], state["state_dict"]["w"])


def test_load_from_checkpoint_and_a_trainer_without_the_plugin(tmp_path: Path, config: Config) -> None:
    checkpoints, _ = _fit_and_keep(tmp_path, config)
    best = checkpoints.best_model_path
    restored = Regressor.load_from_checkpoint(best, weights_only=False)
    assert restored.hparams.width == 48
    reference = AiosnapCheckpointIO(config, allow_pickle=True).load_checkpoint(best)["state_dict"]
    for name, tensor in restored.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    # another machine: a plain Trainer, Lightning's own checkpoint IO
    plain = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    scores = plain.validate(Validated(width=48), loader(), ckpt_path=best, weights_only=False)
    with torch.no_grad():
        x, y = next(iter(loader()))
        expected = torch.nn.functional.mse_loss(restored.net(x), y).item()
    assert scores[0]["val_loss"] == pytest.approx(expected)


class Validated(Regressor):
    def validation_step(self, batch: object, batch_idx: int) -> None:
        x, y = batch  # type: ignore[misc]
        if batch_idx == 0:
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))


def test_a_loggers_scan_finds_the_checkpoints(tmp_path: Path, config: Config) -> None:
    checkpoints, _ = _fit_and_keep(tmp_path, config)
    found = {Path(path).name: tag for _, path, _, tag in _scan_checkpoints(checkpoints, {})}
    assert found == {
        Path(checkpoints.last_model_path).name: "latest",
        **{Path(p).name: found[Path(p).name] for p in checkpoints.best_k_models},
    }
    assert len(found) == 3  # last plus the top 2: what W&B, MLflow and Neptune would upload


def test_resume_with_ckpt_path_last_is_bit_identical(tmp_path: Path, config: Config) -> None:
    straight, first, resumed = stop_and_resume(tmp_path, config, 4, save_last=True)
    assert sorted(resumed.losses) == [s for s in sorted(straight.losses) if s > max(first.losses)]
    assert all(resumed.losses[s] == straight.losses[s] for s in resumed.losses)


def test_a_damaged_tensor_is_caught_by_the_plugin(tmp_path: Path, config: Config) -> None:
    plugin = AiosnapCheckpointIO(config)
    path = tmp_path / "m.ckpt"
    weights = torch.arange(10_000, dtype=torch.float32)
    plugin.save_checkpoint({"state_dict": {"w": weights}}, path)
    plugin.teardown()
    data = bytearray(path.read_bytes())
    where = bytes(data).find(weights[5000:5002].numpy().tobytes())
    data[where] ^= 0xFF  # one flipped bit in the tensor's bytes: torch.load would not notice
    path.write_bytes(bytes(data))
    assert not torch.equal(torch.load(path)["state_dict"]["w"], weights)
    with pytest.raises(ChecksumMismatchError):
        plugin.load_checkpoint(path)
    plugin.teardown()


def test_an_empty_file_left_by_a_first_save_that_never_finished(tmp_path: Path, config: Config) -> None:
    path = tmp_path / "last.ckpt"
    path.touch()  # what a process killed during its first save to the path leaves
    plugin = AiosnapCheckpointIO(config)
    with pytest.raises(FileNotFoundError, match="never completed"):
        plugin.load_checkpoint(path)
    plugin.save_checkpoint({"w": torch.ones(3)}, path)  # the path works on
    assert torch.equal(plugin.load_checkpoint(path)["w"], torch.ones(3))
    plugin.teardown()


def test_overwriting_a_path_replaces_the_file_whole(tmp_path: Path, config: Config) -> None:
    plugin = AiosnapCheckpointIO(config)
    path = tmp_path / "last.ckpt"
    plugin.save_checkpoint({"w": torch.zeros(50_000)}, path)
    plugin.teardown()
    before = path.stat().st_ino
    plugin.save_checkpoint({"w": torch.ones(50_000)}, path)
    plugin.teardown()
    assert path.stat().st_ino != before  # a new file renamed over the old one, not rewritten in place
    assert torch.equal(torch.load(path)["w"], torch.ones(50_000))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no partial files left
