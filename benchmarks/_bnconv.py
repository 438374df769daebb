"""The BatchNorm conv net of the buffer-restore benchmarks (``buffer_restore_cost.py``,
``gpu_features.py``): plain torch, no trainguard import."""

from __future__ import annotations

from torch import Tensor, nn


class BNConv(nn.Module):
    """Three conv + BatchNorm2d + ReLU blocks, pooled, a linear head."""

    def __init__(self, width: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for _ in range(3):
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
            channels = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 10)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.body(x).mean((2, 3)))
        return out
