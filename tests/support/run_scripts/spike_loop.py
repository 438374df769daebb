"""A plain loop (no trainguard) whose targets at one step are 1000 times too large: a loss
spike with finite gradients. MSE over a small MLP, Adam, ``--accum`` micro-batches a step
(``(loss / accum).backward()``); writes each step's micro-batch losses as JSON to ``--out``
and, with ``--weights PATH``, the final ``state_dict`` there.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--spike-step", type=int, default=140)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--weights", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    criterion = nn.MSELoss()
    losses = []
    for step in range(args.steps):
        micro = []
        for _ in range(args.accum):
            x, y = torch.randn(16, 8), torch.randn(16, 1)
            if step == args.spike_step:
                y = y * 1000
            loss = criterion(model(x), y)
            (loss / args.accum).backward()
            micro.append(loss.item())
        opt.step()
        opt.zero_grad()
        losses.append(micro)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(losses, fh)
    if args.weights:
        torch.save(model.state_dict(), args.weights)


if __name__ == "__main__":
    main()
