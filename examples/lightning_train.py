"""PyTorch Lightning with lazyckpt: ModelCheckpoint saves through LazyCheckpointIO, and a
new Trainer resumes from the 'last' checkpoint with exactly the losses of an uninterrupted run.

It trains a small regression network on CPU three ways: straight through for four epochs;
for two epochs with a checkpoint at the end of each (host memory, then a local directory);
and, with a fresh model, fresh tiers and a fresh Trainer, resumed from ``last.ckpt`` for the
last two epochs. The checkpoint files ModelCheckpoint sees are small pointers, written once
their lazyckpt step is durable.

    python examples/lightning_train.py
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import pytorch_lightning as pl
except ImportError:
    import lightning.pytorch as pl  # type: ignore[no-redef]  # the unified package

from lazyckpt.integrations.lightning import LazyCheckpointIO
from tiers import FileTier, HostMemoryTier

EPOCHS = 4

# Lightning's advice for real runs (more data-loader workers, a logger) is noise here
warnings.filterwarnings("ignore", message=".*(num_workers|LeafSpec|exists and is not empty).*")


class Regressor(pl.LightningModule):
    def __init__(self, width: int = 64, lr: float = 3e-3, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, 1))
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        return [opt], [torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=EPOCHS)]

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(256, 16, generator=g)
        return DataLoader(TensorDataset(x, x.pow(2).sum(1, keepdim=True).sqrt()), batch_size=32)


def make_trainer(root: Path, epochs: int, callbacks: list[Any], plugins: list[Any]) -> Any:
    return pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=callbacks,
        plugins=plugins,
    )


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="lazyckpt-lightning-"))
    try:
        straight = Regressor()
        make_trainer(root / "straight", EPOCHS, [], []).fit(straight)

        def checkpoints() -> Any:
            return pl.callbacks.ModelCheckpoint(
                dirpath=str(root / "ckpts"), save_top_k=-1, save_last=True, every_n_epochs=1
            )

        # the part a user writes: one object, as the plugin and as the callback
        io = LazyCheckpointIO([HostMemoryTier(64 << 20), FileTier(root / "store")])
        first = Regressor()
        make_trainer(root, EPOCHS // 2, [io, checkpoints()], [io]).fit(first)
        io.close()

        for name in sorted(p.name for p in (root / "ckpts").iterdir()):
            pointer = json.loads((root / "ckpts" / name).read_text())
            print(f"{name:22s} -> lazyckpt step {pointer['lazyckpt']['step']}")

        io = LazyCheckpointIO([HostMemoryTier(64 << 20), FileTier(root / "store")])
        resumed = Regressor(seed=1234)  # other weights: all of them come from the checkpoint
        make_trainer(root, EPOCHS, [io, checkpoints()], [io]).fit(
            resumed, ckpt_path=str(root / "ckpts" / "last.ckpt")
        )
        print("committed steps:", io.checkpointer.steps())
        io.close()

        half = len(straight.losses) // 2
        same = first.losses == straight.losses[:half] and resumed.losses == straight.losses[half:]
        print(f"{len(resumed.losses)} steps after the resume, last loss {resumed.losses[-1]:.6f}")
        if not same:
            print("losses differ from the uninterrupted run")
            return 1
        print("losses identical bit for bit to the uninterrupted run")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
