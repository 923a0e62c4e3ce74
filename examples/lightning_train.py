"""Lightning training checkpointed through aiosnap's CheckpointIO plugin (CPU is enough).

Fits a small regression model for 3 epochs with ModelCheckpoint (top-2 by loss, plus last),
then resumes from ``last`` for 2 more epochs, and shows what is on disk. Needs
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


def data() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32)


def fit(epochs: int, folder: Path, config: Config, resume: str | None) -> pl.Trainer:
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_model_summary=False,
        default_root_dir=str(folder),
        plugins=[AiosnapCheckpointIO(config)],
        callbacks=[ModelCheckpoint(dirpath=folder / "ckpt", monitor="train_loss", save_top_k=2, save_last=True)],
    )
    trainer.fit(Regressor(), data(), ckpt_path=resume)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--config", help="aiosnap YAML config (RAM budget, events, S3 settings)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    config = load_config(args.config) if args.config else Config(ram_budget="64MiB")
    folder = Path(args.dir or tempfile.mkdtemp(prefix="aiosnap-lightning-"))
    torch.manual_seed(0)
    fit(3, folder, config, resume=None)
    trainer = fit(5, folder, config, resume="last")
    print(f"resumed and finished at epoch {trainer.current_epoch}, global step {trainer.global_step}")
    for path in sorted((folder / "ckpt").iterdir()):
        print(f"  {path.name}  (inspect it: aiosnap info {path})")


if __name__ == "__main__":
    main()
