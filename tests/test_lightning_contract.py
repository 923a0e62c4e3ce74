"""Lightning's checkpoint contract with the aiosnap plugin (issue 14, items 1-4): a symlinked
``last`` removed without touching its target, something at a path as soon as
``save_checkpoint`` returns, a plugin that pickles, a save at the end of a script that is on
disk when the script has exited."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

from aiosnap import Config
from aiosnap.integrations.lightning import AiosnapCheckpointIO, checkpoint_storage
from aiosnap.interop.singlefile import is_archive
from lightning.pytorch.callbacks import ModelCheckpoint
from tests.conftest import FaultyStorage
from tests.test_lightning import QUIET_LIGHTNING, Regressor, loader, stop_and_resume, trainer

REPO = Path(__file__).parent.parent

pytestmark = [QUIET_LIGHTNING]


@pytest.fixture
def config() -> Config:
    return Config(ram_budget="16MiB", upload={"chunk_size": "64KiB"})


def _committed(path: Path) -> bool:
    """A single-file checkpoint aiosnap committed is at ``path``."""
    return is_archive(path)


def test_removing_a_symlinked_last_unlinks_it_and_keeps_its_target(tmp_path: Path, config: Config) -> None:
    plugin = AiosnapCheckpointIO(config)
    target = tmp_path / "epoch=1.ckpt"
    plugin.save_checkpoint({"w": torch.ones(4), "global_step": 1}, target)
    link = tmp_path / "last.ckpt"
    plugin.teardown()  # committed
    os.symlink(target.name, link)
    plugin.remove_checkpoint(link)
    plugin.teardown()  # raises nothing
    assert not link.exists() and not link.is_symlink()
    assert _committed(target)
    assert torch.equal(plugin.load_checkpoint(target)["w"], torch.ones(4))
    plugin.teardown()


def test_save_last_link_on_a_fresh_dirpath_and_removal_of_old_links(tmp_path: Path, config: Config) -> None:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "fresh", save_top_k=-1, every_n_epochs=1, save_last="link")
    trainer(3, AiosnapCheckpointIO(config), [checkpoints], tmp_path).fit(Regressor(), loader())
    last = tmp_path / "fresh" / "last.ckpt"
    assert last.is_symlink()
    target = last.resolve()
    assert target.name.startswith("epoch=2") and _committed(target)
    kept = sorted(p.name for p in (tmp_path / "fresh").iterdir() if not p.is_symlink())
    assert len(kept) == 3, kept  # every epoch's checkpoint survived the link's updates
    reader = AiosnapCheckpointIO(config)
    assert reader.load_checkpoint(last)["epoch"] == 2
    reader.teardown()


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_something_is_at_the_path_when_save_checkpoint_returns(tmp_path: Path, executor: str) -> None:
    config = Config(ram_budget="16MiB", upload={"chunk_size": "64KiB", "executor": executor})
    plugin = AiosnapCheckpointIO(config)
    path = tmp_path / "epoch=0.ckpt"
    plugin.save_checkpoint({"w": torch.ones(4), "global_step": 1}, path)
    assert path.exists()  # at once: ModelCheckpoint's version counter and link code look for it
    plugin.teardown()


def test_the_version_counter_never_reuses_a_path_still_being_written(tmp_path: Path) -> None:
    def slow(url: str, cfg: Config) -> FaultyStorage:
        return FaultyStorage(checkpoint_storage(url, cfg), delay=0.2)

    listings = {}
    for name, plugin in (
        ("torch", None),
        ("aiosnap", AiosnapCheckpointIO(Config(ram_budget="16MiB"), storage_for=slow)),
    ):
        checkpoints = ModelCheckpoint(
            dirpath=tmp_path / name, filename="fixed", monitor="train_loss", save_top_k=-1, every_n_epochs=1
        )
        trainer(3, plugin, [checkpoints], tmp_path).fit(Regressor(), loader())
        listings[name] = sorted(p.name for p in (tmp_path / name).iterdir())
    assert listings["aiosnap"] == listings["torch"] == ["fixed-v1.ckpt", "fixed-v2.ckpt", "fixed.ckpt"]


def test_the_plugin_pickles_and_deep_copies(tmp_path: Path, config: Config) -> None:
    plugin = AiosnapCheckpointIO(config, allow_pickle=True)
    plugin.save_checkpoint({"w": torch.ones(4), "global_step": 1}, tmp_path / "a.ckpt")
    clone = pickle.loads(pickle.dumps(plugin))
    deep = copy.deepcopy(plugin)
    assert clone.config == plugin.config and clone.allow_pickle and deep.config == plugin.config
    plugin.teardown()
    for other in (clone, deep):  # a working plugin of its own
        assert torch.equal(other.load_checkpoint(tmp_path / "a.ckpt")["w"], torch.ones(4))
        other.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "b.ckpt")
        other.teardown()


def test_torch_save_of_a_trainer_with_the_plugin(tmp_path: Path, config: Config) -> None:
    fit = trainer(1, AiosnapCheckpointIO(config), [], tmp_path)
    fit.fit(Regressor(), loader())
    torch.save(fit, tmp_path / "trainer.pt")  # Lightning's own plugins pickle; so must ours
    assert (tmp_path / "trainer.pt").stat().st_size > 0


def test_a_checkpoint_saved_at_the_end_of_a_script_is_on_disk_after_it_exits(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(REPO)!r})
        from tests.test_lightning import Regressor, loader, trainer
        from aiosnap import Config
        from aiosnap.integrations.lightning import AiosnapCheckpointIO
        from aiosnap.integrations.lightning import checkpoint_storage
        from tests.conftest import FaultyStorage
        slow = lambda url, cfg: FaultyStorage(checkpoint_storage(url, cfg), delay=0.2)
        plugin = AiosnapCheckpointIO(Config(ram_budget="16MiB"), storage_for=slow)
        fit = trainer(1, plugin, [], __import__("pathlib").Path({str(tmp_path)!r}))
        fit.fit(Regressor(), loader())
        fit.save_checkpoint({str(tmp_path / "final.ckpt")!r})
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    plugin = AiosnapCheckpointIO(Config(ram_budget="16MiB"))
    loaded: dict[str, Any] = plugin.load_checkpoint(tmp_path / "final.ckpt")
    assert loaded["global_step"] == 4 and "state_dict" in loaded
    plugin.teardown()


def test_resume_from_last_link_continues_identically(tmp_path: Path, config: Config) -> None:
    straight, _, resumed = stop_and_resume(tmp_path, config, 4, save_top_k=-1, save_last="link")
    assert resumed.losses and all(resumed.losses[s] == straight.losses[s] for s in resumed.losses)


def test_another_plugin_instance_waits_for_a_save_in_flight(tmp_path: Path, config: Config) -> None:
    def slow(url: str, cfg: Config) -> FaultyStorage:
        return FaultyStorage(checkpoint_storage(url, cfg), delay=0.5)

    writer = AiosnapCheckpointIO(config, storage_for=slow, plain_reads_wait=False)  # to look before it lands
    reader = AiosnapCheckpointIO(config)
    path = tmp_path / "inflight.ckpt"
    writer.save_checkpoint({"w": torch.full((3,), 7.0), "global_step": 3}, path)
    assert not _committed(path)  # still being written
    assert reader.load_checkpoint(path)["global_step"] == 3  # waited, did not miss it
    writer.teardown()
    reader.teardown()


def test_ddp_spawn_on_cpu_pickles_the_plugin_and_saves(tmp_path: Path, config: Config) -> None:
    import lightning.pytorch as pl

    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    fit = pl.Trainer(
        max_epochs=1, accelerator="cpu", devices=2, strategy="ddp_spawn", plugins=[AiosnapCheckpointIO(config)],
        callbacks=[checkpoints], logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    fit.fit(Regressor(), loader())
    saved = [p for p in (tmp_path / "ckpt").iterdir()]
    assert len(saved) == 1 and _committed(saved[0])
    reader = AiosnapCheckpointIO(config)
    assert "state_dict" in reader.load_checkpoint(saved[0])
    reader.teardown()


def test_a_folder_reached_through_a_symlinked_parent_is_one_checkpoint(tmp_path: Path, config: Config) -> None:
    def slow(url: str, cfg: Config) -> FaultyStorage:
        return FaultyStorage(checkpoint_storage(url, cfg), delay=0.5)

    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "ckpts")
    plugin = AiosnapCheckpointIO(config, storage_for=slow)
    plugin.save_checkpoint({"w": torch.ones(3), "global_step": 1}, tmp_path / "ckpts" / "epoch=0.ckpt")
    assert plugin.load_checkpoint(tmp_path / "ckpts" / "epoch=0.ckpt")["global_step"] == 1  # waited
    assert plugin.load_checkpoint(tmp_path / "real" / "epoch=0.ckpt")["global_step"] == 1
    plugin.teardown()


def test_the_registry_of_saves_in_flight_forgets_finished_saves(tmp_path: Path, config: Config) -> None:
    from aiosnap.integrations import inflight

    plugin = AiosnapCheckpointIO(config)
    for i in range(10):
        plugin.save_checkpoint({"w": torch.ones(3)}, tmp_path / f"{i}.ckpt")
    plugin.teardown()
    assert not any(str(tmp_path) in key for key in inflight._in_flight)


def test_a_first_save_that_failed_leaves_no_empty_file_behind(tmp_path: Path, config: Config) -> None:
    def broken(url: str, cfg: Config) -> FaultyStorage:
        return FaultyStorage(
            checkpoint_storage(url, cfg), fail_when=lambda name: name.endswith("/1.bin"), error=OSError(5, "EIO")
        )

    plugin = AiosnapCheckpointIO(config, storage_for=broken)
    path = tmp_path / "last.ckpt"
    plugin.save_checkpoint({"w": torch.ones(3), "v": torch.ones(100_000)}, path)  # 0.bin lands, 1.bin fails
    assert path.is_file()
    with pytest.raises(OSError):
        plugin.teardown()
    assert not path.exists(), "an empty file would be taken for a checkpoint by ckpt_path='last'"
    assert not list(tmp_path.glob(".*aiosnap-partial")), "the failed attempt's partial file is left behind"
