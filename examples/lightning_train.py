"""Lightning training checkpointed through aiosnap's CheckpointIO plugin (CPU is enough).

Fits a small regression model with ModelCheckpoint (top-2 by loss, plus last) for 3 epochs,
resuming from ``last.ckpt`` when an earlier run left one (Lightning's ``ckpt_path="last"``,
read through aiosnap), then restarts and resumes from ``last`` for 2 more epochs, and shows
what is on disk. Run it again with the same ``--dir`` and it goes on where it stopped. Needs
``pip install 'aiosnap[lightning]'``. Run: ``python examples/lightning_train.py [--dir D]``.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from aiosnap import Config, load_config
from aiosnap.integrations.lightning import AiosnapCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class MoreEpochs(pl.Callback):
    """Train ``epochs`` epochs more than the checkpoint resumed from holds (all of them on a
    fresh start): the run's length counts from where it resumed."""

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs
        self.resumed_at = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.resumed_at = trainer.current_epoch  # restored by then
        trainer.fit_loop.max_epochs = trainer.current_epoch + self.epochs


def data() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32)


def fit(epochs: int, folder: Path, config: Config) -> tuple[pl.Trainer, MoreEpochs]:
    more = MoreEpochs(epochs)
    trainer = pl.Trainer(
        max_epochs=-1,  # MoreEpochs sets the limit once the checkpoint is restored
        accelerator="cpu",
        logger=False,
        enable_model_summary=False,
        default_root_dir=str(folder),
        plugins=[AiosnapCheckpointIO(config)],
        callbacks=[ModelCheckpoint(dirpath=folder / "ckpt", monitor="train_loss", save_top_k=2, save_last=True), more],
    )
    trainer.fit(Regressor(), data(), ckpt_path="last")  # resumes when folder/ckpt holds last.ckpt
    return trainer, more


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--config", help="aiosnap YAML config (RAM budget, events, S3 settings)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*there is no last checkpoint available.*")  # a first run: a fresh start
    config = load_config(args.config) if args.config else Config(ram_budget="64MiB")
    folder = Path(args.dir or tempfile.mkdtemp(prefix="aiosnap-lightning-"))
    torch.manual_seed(0)
    first, more = fit(3, folder, config)
    print(f"trained epochs {more.resumed_at}-{first.current_epoch - 1}")
    trainer, more = fit(2, folder, config)  # a restart: a new Trainer resumes from last.ckpt
    print(f"resumed at epoch {more.resumed_at} and finished at epoch {trainer.current_epoch}, "
          f"global step {trainer.global_step}")  # fmt: skip
    for path in sorted((folder / "ckpt").iterdir()):
        print(f"  {path.name}  (inspect it: aiosnap info {path})")


if __name__ == "__main__":
    main()
