"""The README quick start as a runnable script.

One process:      python examples/quickstart.py
Two ranks (DDP):  python -m torch.distributed.run --nproc-per-node=2 examples/quickstart.py

Rank 1 gets a NaN loss at step 2; every rank skips that step and training goes on.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import trainguard as tg
from trainguard.testing import Fault, FaultPlan


def main() -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    if dist.is_initialized():
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = [torch.randn(16, 8) for _ in range(6)]
    faults = FaultPlan([Fault(step=2, rank=1 if dist.is_initialized() else 0)])

    with tg.Guard(model, optimizer, run_dir="runs/quickstart") as guard:
        for batch in guard.watch(loader):
            loss = faults.loss(model(batch).pow(2).mean(), guard.state.step)
            loss.backward()
            if guard.check(loss):
                optimizer.step()
            optimizer.zero_grad()
    if rank == 0:
        print(f"steps={guard.state.step} skipped={list(guard.state.nonfinite_steps)}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
