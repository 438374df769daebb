"""A Lightning script without any trainguard callback (it imports nothing of trainguard), for
``trainguard run``: Lightning steps the optimizer with a closure (forward and backward run
inside ``optimizer.step``). Sample 9 is 1e30: its squared error is inf at step 2."""

from __future__ import annotations

import sys

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    L.seed_everything(0, verbose=False)
    x = torch.randn(24, 8, generator=torch.Generator().manual_seed(0))
    x[9] = 1e30
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)
    model = Regressor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(f"trained {trainer.global_step} steps; weights finite: {finite}", file=sys.stderr)


if __name__ == "__main__":
    main()
