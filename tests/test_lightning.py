"""The Lightning CheckpointIO plugin with a real Trainer on CPU."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl
from aiosnap import Config
from aiosnap.integrations.lightning import AiosnapCheckpointIO, checkpoint_storage
from aiosnap.interop.singlefile import is_archive
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from tests.conftest import FaultyStorage, s3_config
from torch.utils.data import DataLoader, TensorDataset

QUIET_LIGHTNING = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*",
    "ignore:.*The number of training batches.*",
    "ignore:.*LeafSpec.*:FutureWarning",
    "ignore:Checkpoint directory .* exists and is not empty",
    "ignore:Be aware that when using `ckpt_path`",
)
"""Lightning's advice for real training runs, which these tiny ones do not need."""

pytestmark = [pytest.mark.both_executors, QUIET_LIGHTNING]


class Regressor(pl.LightningModule):
    """Small model with Adam + StepLR: resuming must restore optimizer and scheduler too."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)}


def loader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(64, 1, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)


class LossLog(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses[trainer.global_step] = float(outputs["loss"])


def trainer(epochs: int, plugin: AiosnapCheckpointIO | None, callbacks: list[Callback], root: Path) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        plugins=[plugin] if plugin is not None else None,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        deterministic=True,
    )


@pytest.fixture
def config() -> Config:
    return Config(ram_budget="16MiB", upload={"chunk_size": "64KiB"})


def stop_and_resume(
    tmp_path: Path, config: Config, epochs: int, **checkpointing: Any
) -> tuple[LossLog, LossLog, LossLog]:
    """An uninterrupted run of ``epochs``, and the same run stopped half way and resumed
    with ``ckpt_path="last"`` through the plugin (``ModelCheckpoint(**checkpointing)``):
    the losses of the straight run, of the first half, of the resumed half."""
    torch.manual_seed(0)
    straight = LossLog()
    trainer(epochs, None, [straight], tmp_path / "plain").fit(Regressor(), loader())
    torch.manual_seed(0)
    first = LossLog()
    keep = ModelCheckpoint(dirpath=tmp_path / "ckpt", **checkpointing)
    trainer(epochs // 2, AiosnapCheckpointIO(config), [first, keep], tmp_path).fit(Regressor(), loader())
    resumed = LossLog()
    again = ModelCheckpoint(dirpath=tmp_path / "ckpt", **checkpointing)
    trainer(epochs, AiosnapCheckpointIO(config), [resumed, again], tmp_path).fit(
        Regressor(), loader(), ckpt_path="last"
    )
    return straight, first, resumed


def test_topk_last_and_resume_continue_identically(tmp_path: Path, config: Config) -> None:
    torch.manual_seed(0)
    straight = LossLog()
    trainer(6, None, [straight], tmp_path / "plain").fit(Regressor(), loader())

    torch.manual_seed(0)
    first = LossLog()
    checkpoints = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor="train_loss", save_top_k=2, mode="min", save_last=True
    )
    trainer(3, AiosnapCheckpointIO(config), [first, checkpoints], tmp_path).fit(Regressor(), loader())

    # top-k and last are single-file aiosnap checkpoints; removed ones are gone entirely
    on_disk = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    expected = sorted([Path(p).name for p in checkpoints.best_k_models] + ["last.ckpt"])
    assert on_disk == expected
    assert len(on_disk) == 3
    for name in on_disk:  # each is one committed file
        assert is_archive(tmp_path / "ckpt" / name)

    torch.manual_seed(123)  # resuming must not depend on the process's RNG
    resumed = LossLog()
    plugin = AiosnapCheckpointIO(config)
    again = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="train_loss", save_top_k=2, mode="min", save_last=True)
    assert checkpoints.last_model_path == str(tmp_path / "ckpt" / "last.ckpt")
    trainer(6, plugin, [resumed, again], tmp_path).fit(Regressor(), loader(), ckpt_path="last")  # found by name

    assert sorted(resumed.losses) == [s for s in sorted(straight.losses) if s > max(first.losses)]
    for step, loss in resumed.losses.items():
        assert loss == straight.losses[step], f"step {step}: {loss} != {straight.losses[step]}"
    assert {s: straight.losses[s] for s in first.losses} == first.losses


@pytest.mark.thread_only  # wraps a storage in the trainer's process
def test_save_checkpoint_returns_before_durable_and_loads_back(tmp_path: Path, config: Config) -> None:
    slow = {}

    def storage_for(url: str, cfg: Config) -> FaultyStorage:
        slow[url] = FaultyStorage(checkpoint_storage(url, cfg), delay=1.0)
        return slow[url]

    plugin = AiosnapCheckpointIO(config, storage_for=storage_for, plain_reads_wait=False)  # to look before it lands
    model = Regressor(width=256)
    state = {"state_dict": model.state_dict(), "global_step": 7, "epoch": 1, "note": "x"}
    path = tmp_path / "manual.ckpt"
    started = time.perf_counter()
    plugin.save_checkpoint(state, path)
    returned = time.perf_counter() - started
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on mutating the captured state
    assert not is_archive(path)  # not durable yet
    loaded = plugin.load_checkpoint(path)  # waits for the save in flight
    assert returned < 1.0  # each write to storage takes 1 s
    assert loaded["global_step"] == 7 and loaded["note"] == "x"
    for name, tensor in Regressor(width=256).state_dict().items():
        assert loaded["state_dict"][name].shape == tensor.shape
    assert torch.equal(loaded["state_dict"]["net.0.weight"] + 1.0, model.state_dict()["net.0.weight"])
    plugin.teardown()


def test_overwriting_a_path_keeps_one_version(tmp_path: Path, config: Config) -> None:
    plugin = AiosnapCheckpointIO(config)
    path = tmp_path / "last.ckpt"
    for step in (5, 3):  # a lower step later (after resuming from older state) still wins
        plugin.save_checkpoint({"w": torch.full((4,), float(step)), "global_step": step}, path)
    plugin.teardown()
    assert plugin.load_checkpoint(path)["global_step"] == 3
    assert is_archive(path) and not list(tmp_path.glob(".*aiosnap-partial"))
    plugin.teardown()


@pytest.mark.thread_only  # wraps a storage in the trainer's process
def test_remove_waits_for_pending_save_and_keeps_last_good_on_failure(tmp_path: Path, config: Config) -> None:
    wrappers: dict[str, FaultyStorage] = {}

    def storage_for(url: str, cfg: Config) -> FaultyStorage:
        wrappers[url] = FaultyStorage(checkpoint_storage(url, cfg), delay=0.5 if url.endswith("b.ckpt") else 0.0)
        if url.endswith("c.ckpt"):  # every save there fails
            wrappers[url].fail_when = lambda name: name.endswith(".bin")
            wrappers[url].error = OSError(28, "No space left on device")
        return wrappers[url]

    plugin = AiosnapCheckpointIO(config, storage_for=storage_for)
    old, new, newer = tmp_path / "a.ckpt", tmp_path / "b.ckpt", tmp_path / "c.ckpt"
    plugin.save_checkpoint({"w": torch.ones(8), "global_step": 1}, old)
    plugin.load_checkpoint(old)  # committed

    # a newer save is held in flight; removing the old one must wait for it
    plugin.save_checkpoint({"w": torch.zeros(8), "global_step": 2}, new)
    plugin.remove_checkpoint(old)
    time.sleep(0.2)
    assert is_archive(old)
    plugin.load_checkpoint(new)
    deadline = time.monotonic() + 10
    while old.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not old.exists()

    # the next save fails: removing the last good one is refused (kept, with a warning)
    wrappers[str(new)].delay = 0
    plugin.save_checkpoint({"w": torch.ones(8), "global_step": 3}, newer)
    plugin.remove_checkpoint(new)
    with pytest.raises(OSError, match="No space left"):
        plugin.teardown()
    assert plugin.load_checkpoint(new)["global_step"] == 2
    assert not is_archive(newer)
    plugin.teardown()


@pytest.mark.thread_only  # wraps a storage in the trainer's process
def test_failure_surfaces_at_next_save_with_type(tmp_path: Path, config: Config) -> None:
    def storage_for(url: str, cfg: Config) -> FaultyStorage:
        return FaultyStorage(
            checkpoint_storage(url, cfg), fail_when=lambda n: n.endswith(".bin"), error=PermissionError("ro")
        )

    plugin = AiosnapCheckpointIO(config, storage_for=storage_for)
    plugin.save_checkpoint({"w": torch.ones(4)}, tmp_path / "x.ckpt")
    with pytest.raises(FileNotFoundError):  # waits for the save, which failed: nothing committed
        plugin.load_checkpoint(tmp_path / "x.ckpt")
    with pytest.raises(PermissionError):
        plugin.save_checkpoint({"w": torch.ones(4)}, tmp_path / "y.ckpt")
    plugin.teardown()  # already reported: not raised twice


def test_pickled_objects_need_opt_in(tmp_path: Path, config: Config) -> None:
    plugin = AiosnapCheckpointIO(config)
    path = tmp_path / "p.ckpt"
    plugin.save_checkpoint({"w": torch.ones(2), "odd": {1, 2}}, path)
    from aiosnap.errors import PickleNotAllowedError

    with pytest.raises(PickleNotAllowedError):
        plugin.load_checkpoint(path)
    trusting = AiosnapCheckpointIO(config, allow_pickle=True)
    assert trusting.load_checkpoint(path)["odd"] == {1, 2}
    with pytest.raises(PickleNotAllowedError):
        trusting.load_checkpoint(path, weights_only=True)
    trusting.teardown()
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        plugin.load_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(TypeError, match="storage_options"):
        plugin.save_checkpoint({"w": torch.ones(2)}, path, storage_options={"a": 1})
    plugin.teardown()


def test_torch_save_files_still_load(tmp_path: Path, config: Config) -> None:
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": {"w": torch.arange(3)}, "global_step": 2}, path)
    plugin = AiosnapCheckpointIO(config)
    loaded = plugin.load_checkpoint(path)
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(3))
    plugin.remove_checkpoint(path)  # top-k rotating out a checkpoint from before aiosnap
    plugin.teardown()
    assert not path.exists() and tmp_path.exists()


def test_trainer_against_s3(tmp_path: Path, s3_endpoint: str, s3_bucket: str, s3_client: Any) -> None:
    config = s3_config(s3_endpoint, s3_bucket)
    torch.manual_seed(0)
    straight = LossLog()
    trainer(4, None, [straight], tmp_path / "plain").fit(Regressor(), loader())

    torch.manual_seed(0)
    plugin = AiosnapCheckpointIO(config)
    first = trainer(2, plugin, [], tmp_path / "a")
    first.fit(Regressor(), loader())
    url = f"s3://{s3_bucket}/run/epoch-2.ckpt"
    first.save_checkpoint(url)
    plugin.teardown()
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="run/epoch-2.ckpt/")["Contents"]]
    assert any(k.endswith("manifest.json") for k in keys)

    resumed = LossLog()
    trainer(4, AiosnapCheckpointIO(config), [resumed], tmp_path / "a").fit(Regressor(), loader(), ckpt_path=url)
    assert resumed.losses and all(loss == straight.losses[s] for s, loss in resumed.losses.items())

    plugin = AiosnapCheckpointIO(config)
    plugin.remove_checkpoint(url)
    plugin.teardown()
    assert "Contents" not in s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="run/epoch-2.ckpt/")


@pytest.mark.thread_only  # the upload process is covered by the other tests; this one costs two Lightning runs
def test_the_example_runs_twice_and_resumes(tmp_path: Path) -> None:
    import subprocess
    import sys

    example = Path(__file__).parents[1] / "examples" / "lightning_train.py"
    for trained, resumed in (("epochs 0-2", "at epoch 3 and finished at epoch 5"),
                             ("epochs 5-7", "at epoch 8 and finished at epoch 10")):  # fmt: skip
        run = subprocess.run(
            [sys.executable, str(example), "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300,
            check=False,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        assert f"trained {trained}" in run.stdout and f"resumed {resumed}" in run.stdout, run.stdout[-2000:]
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir())[-1] == "last.ckpt"


@pytest.mark.thread_only  # wraps a storage in the trainer's process
def test_a_slow_removal_never_holds_back_saves_to_other_paths(tmp_path: Path, config: Config) -> None:
    deleting = threading.Event()

    class SlowDeletes(FaultyStorage):
        async def delete_prefix(self, prefix: str) -> None:
            deleting.set()
            await asyncio.sleep(2.0)  # an S3 delete of many objects
            await self.inner.delete_prefix(prefix)

    plugin = AiosnapCheckpointIO(config, storage_for=lambda url, cfg: SlowDeletes(checkpoint_storage(url, cfg)))
    old, new = tmp_path / "old.ckpt", tmp_path / "new.ckpt"
    plugin.save_checkpoint({"w": torch.ones(8)}, old)
    plugin.load_checkpoint(old)
    plugin.remove_checkpoint(old)
    assert deleting.wait(10)
    started = time.monotonic()
    plugin.save_checkpoint({"w": torch.zeros(8)}, new)  # training goes on while old.ckpt is deleted
    assert time.monotonic() - started < 1.0
    plugin.teardown()
    assert not old.exists() and plugin.load_checkpoint(new)["w"].sum() == 0
    plugin.teardown()
