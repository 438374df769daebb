"""A LightningCLI-shaped DDP job with Lightning's defaults, for ``trainguard run``: it imports
nothing of trainguard. Two CPU ranks (Lightning's own launcher, gloo), the sanity-check
validation before training (which leaves the DDP wrapper in eval mode), a validation every
epoch, 3 steps an epoch. At the start of epoch ``--nan-epoch`` one sample of the given
rank's shard turns NaN (in that epoch only)."""

from __future__ import annotations

import argparse
import sys

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

SAMPLES = 24
BATCH = 4


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class NanAtEpoch(L.Callback):
    """Makes one sample NaN for one epoch: one of ``rank``'s shard (the distributed sampler
    deals sample ``i`` to rank ``i % 2``)."""

    def __init__(self, x: Tensor, epoch: int, rank: int) -> None:
        self.x, self.epoch, self.index = x, epoch, 2 * BATCH + rank
        self.kept = x[self.index].clone()

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.x[self.index] = float("nan") if trainer.current_epoch == self.epoch else self.kept


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nan-epoch", type=int, default=1)
    parser.add_argument("--nan-rank", type=int, default=1)
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    x = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(0))
    train = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=BATCH)
    val = DataLoader(TensorDataset(x[:8], x[:8].sum(dim=1, keepdim=True)), batch_size=BATCH)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regressor()
    trainer.callbacks.append(NanAtEpoch(x, args.nan_epoch, args.nan_rank))
    trainer.fit(model, train, val)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(
        f"rank {trainer.global_rank}: trained {trainer.global_step} steps; weights finite: "
        f"{finite}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
